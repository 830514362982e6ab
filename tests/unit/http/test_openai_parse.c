/* Unit tests of the OpenAI request parser/validator (src/http/openai.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "http/http_internal.h"
#include "test_util.h"

static const struct oai_limits LIM = {.served_name = "stories260K", .n_vocab = 512, .max_model_len = 512};

struct bad_case {
    enum oai_kind kind;
    const char *body;
    int status;
    const char *param; /* "" = null */
    const char *code;  /* NULL = null */
};

#define C OAI_COMPLETION
#define H OAI_CHAT
#define T OAI_TOKENIZE
#define D OAI_DETOKENIZE
static const struct bad_case bad[] = {
    /* malformed bodies */
    {C, "", 400, "", NULL},
    {C, "{", 400, "", NULL},
    {C, "{\"prompt\": \"a\",}", 400, "", NULL},
    {C, "[1,2]", 400, "", NULL},
    {C, "\"prompt\"", 400, "", NULL},
    {C, "{\"prompt\":\"a\",\"prompt\":\"b\"}", 400, "", NULL},
    {C, "{\"prompt\":\"\xff\xfe\"}", 400, "", NULL},             /* invalid UTF-8 */
    {C, "{\"prompt\":\"a\\u0000b\"}", 400, "", NULL},           /* NUL in a string */
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\x28\"}]}", 400, "", NULL},
    /* prompt */
    {C, "{}", 400, "prompt", NULL},
    {C, "{\"prompt\": null}", 400, "prompt", NULL},
    {C, "{\"prompt\": 5}", 400, "prompt", NULL},
    {C, "{\"prompt\": {}}", 400, "prompt", NULL},
    {C, "{\"prompt\": []}", 400, "prompt", NULL},
    {C, "{\"prompt\": [\"a\", \"b\"]}", 400, "prompt", NULL},
    {C, "{\"prompt\": [[1,2],[3]]}", 400, "prompt", NULL},
    {C, "{\"prompt\": [1, \"x\"]}", 400, "prompt", NULL},
    {C, "{\"prompt\": [1, 2.5]}", 400, "prompt", NULL},
    {C, "{\"prompt\": [1, -3]}", 400, "prompt", NULL},
    {C, "{\"prompt\": [1, 512]}", 400, "prompt", NULL},
    {C, "{\"prompt\": [[]]}", 400, "prompt", NULL},
    /* disaggregated_params */
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":5}", 400, "disaggregated_params", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"both\",\"disagg_request_id\":1}}", 400, "disaggregated_params.request_type", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"context_only\"}}", 400, "disaggregated_params.disagg_request_id", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"context_only\",\"disagg_request_id\":-1}}", 400, "disaggregated_params.disagg_request_id", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"context_only\",\"disagg_request_id\":9007199254740992}}", 400, "disaggregated_params.disagg_request_id", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"context_only\",\"disagg_request_id\":1,\"bogus\":1}}", 400, "disaggregated_params", NULL},
    {C, "{\"prompt\":\"a\",\"stream\":true,\"disaggregated_params\":{\"request_type\":\"context_only\",\"disagg_request_id\":1}}", 400, "stream", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\"}}", 400, "disaggregated_params.first_gen_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"127.0.0.1:99999\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"nohost\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\":5\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:0\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:5x\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:-1\",\"first_gen_tokens\":[5]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\",\"first_gen_tokens\":[512]}}", 400, "disaggregated_params.first_gen_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\",\"first_gen_tokens\":[1,2]}}", 400, "disaggregated_params.first_gen_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\",\"first_gen_tokens\":[1],\"prompt_token_ids\":[]}}", 400, "disaggregated_params.prompt_token_ids", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":7,\"first_gen_tokens\":[1]}}", 400, "disaggregated_params.ctx_info_endpoint", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\",\"schedule_style\":\"x\"}}", 400, "disaggregated_params.schedule_style", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\",\"first_gen_tokens\":[1],\"first_gen_logprobs\":{\"id\":1,\"logprob\":-1,\"top\":[[999999,-0.1]]}}}", 400, "disaggregated_params.first_gen_logprobs", NULL},
    {C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1,\"ctx_info_endpoint\":\"h:1\",\"first_gen_tokens\":[1],\"first_gen_logprobs\":{\"id\":-5,\"logprob\":-1}}}", 400, "disaggregated_params.first_gen_logprobs", NULL},
    /* model */
    {C, "{\"prompt\":\"a\",\"model\":\"gpt-4\"}", 404, "model", "model_not_found"},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"model\":\"x\"}", 404, "model", "model_not_found"},
    {C, "{\"prompt\":\"a\",\"model\":7}", 400, "model", NULL},
    /* max_tokens */
    {C, "{\"prompt\":\"a\",\"max_tokens\":-1}", 400, "max_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"max_tokens\":0}", 400, "max_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"max_tokens\":100000000000}", 400, "max_tokens", NULL},
    /* over max_model_len is refused after tokenizing, beside the prompt (prep.c; e2e http_api) */
    {C, "{\"prompt\":\"a\",\"max_tokens\":2147483648}", 400, "max_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"max_tokens\":\"16\"}", 400, "max_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"max_tokens\":1.5}", 400, "max_tokens", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":-5}", 400, "max_completion_tokens", NULL},
    /* sampling */
    {C, "{\"prompt\":\"a\",\"temperature\":-0.1}", 400, "temperature", NULL},
    {C, "{\"prompt\":\"a\",\"temperature\":2.5}", 400, "temperature", NULL},
    {C, "{\"prompt\":\"a\",\"temperature\":\"hot\"}", 400, "temperature", NULL},
    {C, "{\"prompt\":\"a\",\"top_p\":0}", 400, "top_p", NULL},
    {C, "{\"prompt\":\"a\",\"top_p\":1.01}", 400, "top_p", NULL},
    /* > 0 as a double but 0 as the engine's float: rejected here with the param named */
    {C, "{\"prompt\":\"a\",\"top_p\":1e-300}", 400, "top_p", NULL},
    {C, "{\"prompt\":\"a\",\"repetition_penalty\":1e-300}", 400, "repetition_penalty", NULL},
    {C, "{\"prompt\":\"a\",\"top_k\":-2}", 400, "top_k", NULL},
    {C, "{\"prompt\":\"a\",\"top_k\":true}", 400, "top_k", NULL},
    {C, "{\"prompt\":\"a\",\"min_p\":1.5}", 400, "min_p", NULL},
    {C, "{\"prompt\":\"a\",\"presence_penalty\":3}", 400, "presence_penalty", NULL},
    {C, "{\"prompt\":\"a\",\"frequency_penalty\":-2.1}", 400, "frequency_penalty", NULL},
    {C, "{\"prompt\":\"a\",\"repetition_penalty\":0}", 400, "repetition_penalty", NULL},
    {C, "{\"prompt\":\"a\",\"seed\":\"x\"}", 400, "seed", NULL},
    {C, "{\"prompt\":\"a\",\"seed\":1.25}", 400, "seed", NULL},
    /* stop */
    {C, "{\"prompt\":\"a\",\"stop\":5}", 400, "stop", NULL},
    {C, "{\"prompt\":\"a\",\"stop\":[\"a\",3]}", 400, "stop", NULL},
    {C, "{\"prompt\":\"a\",\"stop\":[\"\"]}", 400, "stop", NULL},
    {C, "{\"prompt\":\"a\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}", 400, "stop", NULL},
    /* flags */
    {C, "{\"prompt\":\"a\",\"stream\":\"yes\"}", 400, "stream", NULL},
    {C, "{\"prompt\":\"a\",\"stream\":1}", 400, "stream", NULL},
    {C, "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", 400, "stream_options", NULL},
    {C, "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":[]}", 400, "stream_options", NULL},
    {C, "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":{\"include_usage\":\"y\"}}", 400, "stream_options.include_usage", NULL},
    {C, "{\"prompt\":\"a\",\"n\":0}", 400, "n", NULL},
    {C, "{\"prompt\":\"a\",\"n\":129}", 400, "n", NULL},
    {C, "{\"prompt\":\"a\",\"n\":2.5}", 400, "n", NULL},
    {C, "{\"prompt\":\"a\",\"n\":2,\"best_of\":3}", 400, "best_of", NULL},
    /* logit_bias, stop_token_ids, min_tokens, priority */
    {C, "{\"prompt\":\"a\",\"logit_bias\":[1]}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"512\":1}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"-1\":1}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"x\":1}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"1x\":1}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"5\":100.5}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"5\":-101}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"logit_bias\":{\"5\":\"1\"}}", 400, "logit_bias", NULL},
    {C, "{\"prompt\":\"a\",\"stop_token_ids\":5}", 400, "stop_token_ids", NULL},
    {C, "{\"prompt\":\"a\",\"stop_token_ids\":[512]}", 400, "stop_token_ids", NULL},
    {C, "{\"prompt\":\"a\",\"stop_token_ids\":[\"2\"]}", 400, "stop_token_ids", NULL},
    {C, "{\"prompt\":\"a\",\"min_tokens\":17}", 400, "min_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"min_tokens\":-1}", 400, "min_tokens", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":8,\"min_tokens\":9}", 400, "min_tokens", NULL},
    {C, "{\"prompt\":\"a\",\"priority\":\"high\"}", 400, "priority", NULL},
    {C, "{\"prompt\":\"a\",\"priority\":1.5}", 400, "priority", NULL},
    {C, "{\"prompt\":\"a\",\"echo\":true}", 400, "echo", NULL},
    {C, "{\"prompt\":\"a\",\"logprobs\":6}", 400, "logprobs", NULL},
    {C, "{\"prompt\":\"a\",\"logprobs\":true}", 400, "logprobs", NULL},
    {C, "{\"prompt\":\"a\",\"ignore_eos\":\"no\"}", 400, "ignore_eos", NULL},
    {C, "{\"prompt\":\"a\",\"user\":42}", 400, "user", NULL},
    {C, "{\"prompt\":\"a\",\"best_of\":3}", 400, "best_of", NULL},
    /* a message other than assistant needs content; continue_final_message */
    {H, "{\"messages\":[{\"role\":\"user\"}]}", 400, "messages[0].content", NULL},
    {H, "{\"messages\":[{\"role\":\"system\",\"content\":null},{\"role\":\"user\",\"content\":\"x\"}]}", 400, "messages[0].content", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"content\":\"b\"}],\"continue_final_message\":true,\"add_generation_prompt\":true}", 400, "continue_final_message", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\"}],\"continue_final_message\":true}", 400, "continue_final_message", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"continue_final_message\":1}", 400, "continue_final_message", NULL},
    /* chat */
    {H, "{}", 400, "messages", NULL},
    {H, "{\"messages\":[]}", 400, "messages", NULL},
    {H, "{\"messages\":\"hi\"}", 400, "messages", NULL},
    {H, "{\"messages\":[\"hi\"]}", 400, "messages[0]", NULL},
    {H, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages[0].role", NULL},
    {H, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"hi\"}]}", 400, "messages[0].role", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "messages[0].content", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400, "messages[1].content", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", 400, "messages[0].content", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logprobs\":1}", 400, "logprobs", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logprobs\":true,\"top_logprobs\":21}", 400, "top_logprobs", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"top_logprobs\":2}", 400, "top_logprobs", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\"}]}", 400, "tools", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":{}}", 400, "tools", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]}", 400, "tools", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"retrieval\",\"function\":{\"name\":\"f\"}}]}", 400, "tools", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]}", 400, "tools", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[\"f\"]}", 400, "tools", NULL},
    /* a call's arguments are an object: a parameters schema of another type is refused */
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"string\"}}}]}", 400, "tools", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tool_choice\":\"required\"}", 400, "tool_choice", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tool_choice\":3}", 400, "tool_choice", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"chat_template_kwargs\":[1]}", 400, "chat_template_kwargs", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"chat_template_kwargs\":\"x\"}", 400, "chat_template_kwargs", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"add_generation_prompt\":\"no\"}", 400, "add_generation_prompt", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":5}", 400, "cache_salt", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"cache_salt\":\"\"}", 400, "cache_salt", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"tool_calls\":[]}]}", 400, "messages[0].tool_calls", NULL},
    {H, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":{}}]}", 400, "messages[0].tool_calls", NULL},
    {H, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]}", 400, "messages[0].tool_calls[0]", NULL},
    {H, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{bad\"}}]}]}", 400, "messages[0].tool_calls[0]", NULL},
    {H, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"x\",\"function\":{\"name\":\"f\"}}]}]}", 400, "messages[0].tool_calls[0]", NULL},
    {H, "{\"messages\":[{\"role\":\"tool\",\"content\":\"1\",\"tool_call_id\":7}]}", 400, "messages[0].tool_call_id", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"1\",\"name\":[]}]}", 400, "messages[0].name", NULL},
    {C, "{\"prompt\":\"a\",\"cache_salt\":[\"s\"]}", 400, "cache_salt", NULL},
    {T, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":5}", 400, "tools", NULL},
    /* structured output and tool choice (structured.c) */
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"xml\"}}", 400, "response_format", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":\"json\"}", 400, "response_format", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"json_schema\"}}", 400, "response_format.json_schema", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":3}}}", 400, "response_format.json_schema.schema", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"strict\":\"yes\",\"schema\":{}}}}", 400, "response_format.json_schema.strict", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":1}}}", 400, "response_format.json_schema.name", NULL},
    {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"regex\":1}}", 400, "structured_outputs.regex", NULL},
    {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"choice\":[]}}", 400, "structured_outputs.choice", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":\"json_object\"},\"guided_regex\":\"a\"}", 400, "guided_regex", NULL},
    {C, "{\"prompt\":\"a\",\"guided_json\":\"{not json\"}", 400, "guided_json", NULL},
    {C, "{\"prompt\":\"a\",\"guided_json\":[1]}", 400, "guided_json", NULL},
    {C, "{\"prompt\":\"a\",\"guided_regex\":5}", 400, "guided_regex", NULL},
    {C, "{\"prompt\":\"a\",\"guided_choice\":[]}", 400, "guided_choice", NULL},
    {C, "{\"prompt\":\"a\",\"guided_choice\":[\"a\",1]}", 400, "guided_choice", NULL},
    {C, "{\"prompt\":\"a\",\"guided_grammar\":{}}", 400, "guided_grammar", NULL},
    {C, "{\"prompt\":\"a\",\"guided_whitespace_pattern\":\" *\"}", 400, "guided_whitespace_pattern", NULL},
    {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"xml\":1}}", 400, "structured_outputs", NULL},
    {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"regex\":\"a\",\"choice\":[\"b\"]}}", 400, "structured_outputs", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}", 400, "tool_choice", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"sometimes\"}", 400, "tool_choice", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"function\":{\"name\":\"f\"}}}", 400, "tool_choice", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"parallel_tool_calls\":1}", 400, "parallel_tool_calls", NULL},
    /* tokenize / detokenize */
    {T, "{}", 400, "prompt", NULL},
    {T, "{\"prompt\":\"a\",\"add_special_tokens\":\"yes\"}", 400, "add_special_tokens", NULL},
    /* token-id prompts to /tokenize are checked against the vocabulary (were echoed, and ids
     * >= 2^31 were silently truncated: 4294967297 came back as 1) */
    {T, "{\"prompt\":[1, 512]}", 400, "prompt", NULL},
    {T, "{\"prompt\":[4294967297]}", 400, "prompt", NULL},
    {D, "{}", 400, "tokens", NULL},
    {D, "{\"tokens\":\"1 2\"}", 400, "tokens", NULL},
    {D, "{\"tokens\":[1, 99999]}", 400, "tokens", NULL},
    /* fields no parser reads are a 400 naming them (OpenAI: "Unrecognized request argument
     * supplied"), never silently ignored: a typo must not leave a default in place */
    {C, "{\"prompt\":\"a\",\"max_token\":2}", 400, "max_token", NULL},
    {C, "{\"prompt\":\"a\",\"temprature\":0}", 400, "temprature", NULL},
    {C, "{\"prompt\":\"a\",\"top_logprobs\":2}", 400, "top_logprobs", NULL}, /* chat's field */
    {C, "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":{\"include_usage\":true,\"zzz\":1}}", 400,
     "stream_options.zzz", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"bogus\":1}", 400, "bogus", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"echo\":false}", 400, "echo", NULL},
    {H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"store\":true}", 400, "store", NULL},
    {T, "{\"prompt\":\"a\",\"zz\":1}", 400, "zz", NULL},
    {T, "{\"prompt\":\"a\",\"max_tokens\":3}", 400, "max_tokens", NULL},
    {D, "{\"tokens\":[1],\"skip_special_tokens\":true}", 400, "skip_special_tokens", NULL},
};

static void test_bad_inputs(void **state) {
    (void)state;
    size_t n = sizeof bad / sizeof bad[0];
    assert_true(n >= 30);
    for (size_t i = 0; i < n; i++) {
        struct oai_request r;
        struct oai_error e;
        kv_status st = oai_parse(bad[i].kind, bad[i].body, strlen(bad[i].body), &LIM, &r, &e);
        if (st != KV_EINVAL || e.status != bad[i].status || strcmp(e.param, bad[i].param) != 0 ||
            (bad[i].code ? !e.code || strcmp(e.code, bad[i].code) : e.code != NULL)) {
            fprintf(stderr, "case %zu %s: st=%d status=%d param='%s' code=%s msg=%s\n", i, bad[i].body,
                    st, e.status, e.param, e.code ? e.code : "null", e.message);
            fail();
        }
        assert_non_null(e.type);
        assert_true(strlen(e.message) > 0);
        /* nothing left to free after a failure */
        assert_null(r.text);
        assert_null(r.ids);
        assert_null(r.chat_msgs);
        assert_null(r.chat_kwargs);
        assert_null(r.cache_salt);
        assert_null(r.stop);
        /* the error renders as OpenAI JSON */
        char *js = resp_error_json(&e);
        assert_non_null(js);
        json_t *o = json_loads(js, 0, NULL);
        assert_non_null(o);
        json_t *eo = json_object_get(o, "error");
        assert_true(json_is_string(json_object_get(eo, "message")));
        assert_true(json_is_string(json_object_get(eo, "type")));
        if (bad[i].param[0])
            assert_string_equal(json_string_value(json_object_get(eo, "param")), bad[i].param);
        else
            assert_true(json_is_null(json_object_get(eo, "param")));
        json_decref(o);
        free(js);
    }
}

static void test_prompt_too_long_ids(void **state) {
    (void)state;
    kv_buf b;
    kv_buf_init(&b);
    kv_buf_puts(&b, "{\"prompt\":[");
    for (int i = 0; i < 512; i++) kv_buf_printf(&b, "%s%d", i ? "," : "", i % 500);
    kv_buf_puts(&b, "]}");
    struct oai_request r;
    struct oai_error e;
    assert_int_equal(oai_parse(C, b.data, b.len, &LIM, &r, &e), KV_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.code, "context_length_exceeded");
    kv_buf_free(&b);
}

static void parse_ok(enum oai_kind k, const char *body, struct oai_request *r) {
    struct oai_error e;
    kv_status st = oai_parse(k, body, strlen(body), &LIM, r, &e);
    if (st) fprintf(stderr, "unexpected error for %s: %d %s (%s)\n", body, e.status, e.message, e.param);
    assert_int_equal(st, KV_OK);
}

static void test_completion_defaults(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(C, "{\"prompt\":\"Once upon a time\"}", &r);
    assert_true(r.has_text);
    assert_string_equal(r.text, "Once upon a time");
    assert_int_equal(r.text_len, 16);
    assert_int_equal(r.max_tokens, 16);
    assert_false(r.stream);
    int32_t ids[3] = {1, 403, 407};
    struct engine_request_params p;
    oai_engine_params(&r, ids, 3, 512, &p);
    assert_ptr_equal(p.prompt_ids, ids);
    assert_int_equal(p.n_prompt, 3);
    assert_int_equal(p.max_tokens, 16);
    assert_true(p.sp.temperature == 1.0f);
    assert_true(p.sp.top_p == 1.0f);
    assert_int_equal(p.sp.top_k, 0);
    assert_true(p.sp.min_p == 0.0f);
    assert_true(p.sp.repetition_penalty == 1.0f);
    assert_false(p.sp.has_seed);
    assert_false(p.sp.logprobs);
    assert_int_equal(p.n_stop, 0);
    assert_false(p.ignore_eos);
    oai_request_free(&r);
}

static void test_completion_full(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(C,
             "{\"model\":\"stories260K\",\"prompt\":[\"Hi there\"],\"max_tokens\":64,"
             "\"temperature\":0,\"top_p\":0.9,\"top_k\":40,\"min_p\":0.05,\"seed\":-1,"
             "\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,\"repetition_penalty\":1.1,"
             "\"stop\":[\"\\n\",\"The end\"],\"ignore_eos\":true,\"logprobs\":5,\"echo\":false,"
             "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"n\":1,\"user\":\"u\","
             "\"cache_salt\":\"s\",\"conversation_id\":\"c\",\"unknown_field\":null}",
             &r);
    assert_string_equal(r.text, "Hi there");
    assert_true(r.stream);
    assert_true(r.include_usage);
    struct engine_request_params p;
    int32_t ids[2] = {1, 2};
    oai_engine_params(&r, ids, 2, 512, &p);
    assert_int_equal(p.max_tokens, 64);
    assert_true(p.sp.temperature == 0.0f);
    assert_true(p.sp.top_p == 0.9f);
    assert_int_equal(p.sp.top_k, 40);
    assert_true(p.sp.min_p == 0.05f);
    assert_true(p.sp.has_seed);
    assert_true(p.sp.seed == UINT64_MAX);
    assert_true(p.sp.presence_penalty == 0.5f);
    assert_true(p.sp.frequency_penalty == -0.5f);
    assert_true(p.sp.repetition_penalty == 1.1f);
    assert_int_equal(p.n_stop, 2);
    assert_string_equal(p.stop[0], "\n");
    assert_string_equal(p.stop[1], "The end");
    assert_true(p.ignore_eos);
    assert_true(p.sp.logprobs);
    assert_int_equal(p.sp.top_logprobs, 5);
    assert_string_equal(p.cache_salt, "s");
    assert_int_equal(p.n, 1);
    assert_int_equal(p.n_logit_bias, 0);
    assert_int_equal(p.min_tokens, 0);
    assert_int_equal(p.priority, 0);
    oai_request_free(&r);
}

static void test_sampling_fields(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(C,
             "{\"prompt\":\"a\",\"n\":3,\"best_of\":3,\"logit_bias\":{\"7\":-100,\"511\":2.5,\"0\":100},"
             "\"stop_token_ids\":[2,13],\"min_tokens\":16,\"priority\":-7,\"seed\":9}",
             &r);
    struct engine_request_params p;
    int32_t ids[1] = {1};
    oai_engine_params(&r, ids, 1, 512, &p);
    assert_int_equal(p.n, 3);
    assert_int_equal(p.n_logit_bias, 3);
    int seen = 0;
    for (int i = 0; i < 3; i++) {
        if (p.logit_bias[i].id == 7) seen += p.logit_bias[i].bias == -100.0f;
        if (p.logit_bias[i].id == 511) seen += p.logit_bias[i].bias == 2.5f;
        if (p.logit_bias[i].id == 0) seen += p.logit_bias[i].bias == 100.0f;
    }
    assert_int_equal(seen, 3);
    assert_int_equal(p.n_stop_token_ids, 2);
    assert_int_equal(p.stop_token_ids[1], 13);
    assert_int_equal(p.min_tokens, 16);
    assert_int_equal(p.priority, -7);
    oai_request_free(&r);
    /* chat: min_tokens is checked against max_completion_tokens when given */
    parse_ok(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"min_tokens\":400}", &r);
    assert_int_equal(r.min_tokens, 400);
    oai_request_free(&r);
    /* ... and its message names the field the client sent (F6) */
    {
        const char *mb = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":8,\"min_tokens\":9}";
        struct oai_error e;
        assert_int_equal(oai_parse(H, mb, strlen(mb), &LIM, &r, &e), KV_EINVAL);
        assert_string_equal(e.message, "'min_tokens' must be between 0 and 'max_completion_tokens' (8)");
        mb = "{\"prompt\":\"a\",\"max_tokens\":8,\"min_tokens\":9}";
        assert_int_equal(oai_parse(C, mb, strlen(mb), &LIM, &r, &e), KV_EINVAL);
        assert_string_equal(e.message, "'min_tokens' must be between 0 and 'max_tokens' (8)");
    }
    /* continue_final_message: add_generation_prompt defaults to false then */
    parse_ok(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"Once\"}],"
                "\"continue_final_message\":true}", &r);
    assert_true(r.continue_final_message);
    assert_false(r.add_generation_prompt);
    oai_request_free(&r);
    /* aliases of the served name */
    static const char *const al[] = {"a1", "a2"};
    struct oai_limits lim = LIM;
    lim.aliases = al;
    lim.n_aliases = 2;
    struct oai_error e;
    const char *body = "{\"prompt\":\"a\",\"model\":\"a2\"}";
    assert_int_equal(oai_parse(C, body, strlen(body), &lim, &r, &e), KV_OK);
    oai_request_free(&r);
    assert_int_equal(oai_parse(C, body, strlen(body), &LIM, &r, &e), KV_EINVAL);
    assert_int_equal(e.status, 404);
}

static void test_completion_token_prompt(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(C, "{\"prompt\":[1,403,407,261,378],\"stop\":\"x\",\"top_k\":-1,\"model\":\"\"}", &r);
    assert_false(r.has_text);
    assert_int_equal(r.n_ids, 5);
    assert_int_equal(r.ids[0], 1);
    assert_int_equal(r.ids[4], 378);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "x");
    assert_int_equal(r.sp.top_k, 0);
    oai_request_free(&r);
    parse_ok(C, "{\"prompt\":[[5,6]],\"logprobs\":0,\"max_tokens\":null,\"seed\":7}", &r);
    assert_int_equal(r.n_ids, 2);
    assert_int_equal(r.ids[1], 6);
    assert_true(r.sp.logprobs);
    assert_int_equal(r.sp.top_logprobs, 0);
    assert_int_equal(r.max_tokens, 16);
    assert_true(r.sp.seed == 7);
    oai_request_free(&r);
    parse_ok(C, "{\"prompt\":\"\",\"max_tokens\":512}", &r); /* empty text is a valid prompt */
    assert_true(r.has_text);
    assert_int_equal(r.text_len, 0);
    assert_int_equal(r.max_tokens, 512);
    oai_request_free(&r);
}

static const char *msg_str(const struct oai_request *r, size_t i, const char *k) {
    return json_string_value(json_object_get(json_array_get(r->chat_msgs, i), k));
}

static void test_chat(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(H,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
             "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Tell \"},"
             "{\"type\":\"text\",\"text\":\"me\"}]},{\"role\":\"assistant\",\"content\":null}],"
             "\"logprobs\":true,\"top_logprobs\":20,\"max_completion_tokens\":7,\"temperature\":0.7}",
             &r);
    assert_int_equal(json_array_size(r.chat_msgs), 3);
    assert_string_equal(msg_str(&r, 0, "role"), "system");
    assert_string_equal(msg_str(&r, 0, "content"), "Be brief.");
    assert_string_equal(msg_str(&r, 1, "content"), "Tell \nme"); /* parts joined with \n (vLLM) */
    /* an assistant turn without content reaches the template as null */
    assert_true(json_is_null(json_object_get(json_array_get(r.chat_msgs, 2), "content")));
    assert_null(r.chat_kwargs);
    assert_true(r.add_generation_prompt);
    assert_true(r.sp.logprobs);
    assert_int_equal(r.sp.top_logprobs, 20);
    assert_int_equal(r.max_tokens, 7);
    oai_request_free(&r);
    /* chat default: until the context ends */
    parse_ok(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", &r);
    assert_int_equal(r.max_tokens, -1);
    struct engine_request_params p;
    int32_t ids[50] = {0};
    oai_engine_params(&r, ids, 50, 512, &p);
    assert_int_equal(p.max_tokens, 462);
    assert_true(p.sp.temperature == 1.0f);
    oai_request_free(&r);
}

static void test_chat_tools(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(H,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\",\"name\":\"bob\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
             "\"function\":{\"name\":\"get\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}},"
             "{\"function\":{\"name\":\"noargs\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"sunny\"}],"
             "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get\",\"parameters\":{\"type\":\"object\"}}}],"
             "\"tool_choice\":\"auto\",\"chat_template_kwargs\":{\"enable_thinking\":false},"
             "\"add_generation_prompt\":false,\"cache_salt\":\"tenant-1\"}",
             &r);
    assert_int_equal(json_array_size(r.chat_msgs), 3);
    assert_string_equal(msg_str(&r, 0, "name"), "bob");
    json_t *a = json_array_get(r.chat_msgs, 1);
    assert_true(json_is_null(json_object_get(a, "content")));
    json_t *calls = json_object_get(a, "tool_calls");
    assert_int_equal(json_array_size(calls), 2);
    json_t *c0 = json_array_get(calls, 0);
    assert_string_equal(json_string_value(json_object_get(c0, "id")), "c1");
    /* arguments given as a JSON string reach the template as an object (vLLM) */
    json_t *args = json_object_get(json_object_get(c0, "function"), "arguments");
    assert_true(json_is_object(args));
    assert_string_equal(json_string_value(json_object_get(args, "city")), "Paris");
    json_t *args1 = json_object_get(json_object_get(json_array_get(calls, 1), "function"), "arguments");
    assert_true(json_is_object(args1) && json_object_size(args1) == 0);
    assert_string_equal(msg_str(&r, 2, "tool_call_id"), "c1");
    assert_non_null(r.chat_kwargs);
    assert_true(json_is_false(json_object_get(r.chat_kwargs, "enable_thinking")));
    assert_int_equal(json_array_size(json_object_get(r.chat_kwargs, "tools")), 1);
    assert_false(r.add_generation_prompt);
    assert_string_equal(r.cache_salt, "tenant-1");
    oai_request_free(&r);
    /* chat_template_kwargs override tools (as vLLM); empty tools add nothing */
    parse_ok(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[],\"tool_choice\":\"none\"}", &r);
    assert_null(r.chat_kwargs);
    oai_request_free(&r);
    /* cache_salt: 256 bytes ok, 257 rejected */
    char body[700];
    char salt[258];
    memset(salt, 'z', 257);
    salt[256] = 0;
    snprintf(body, sizeof body, "{\"prompt\":\"a\",\"cache_salt\":\"%s\"}", salt);
    parse_ok(C, body, &r);
    assert_int_equal(strlen(r.cache_salt), 256);
    oai_request_free(&r);
    salt[256] = 'z';
    salt[257] = 0;
    snprintf(body, sizeof body, "{\"prompt\":\"a\",\"cache_salt\":\"%s\"}", salt);
    struct oai_error e;
    assert_int_equal(oai_parse(C, body, strlen(body), &LIM, &r, &e), KV_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "cache_salt");
}

/* Structured output: parsed, then compiled (oai_structured_compile) into a grammar; errors
 * name the field and the unsupported construct. */
static void test_structured(void **state) {
    (void)state;
    struct { int kind; const char *body; enum oai_so_kind so; bool grammar, parse_tools; } ok[] = {
        {H, "%s\"response_format\":{\"type\":\"text\"}}", OAI_SO_NONE, false, false},
        {H, "%s\"response_format\":{\"type\":\"json_object\"}}", OAI_SO_JSON_OBJECT, true, false},
        {H, "%s\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"strict\":true,\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"],\"additionalProperties\":false}}}}",
         OAI_SO_JSON_SCHEMA, true, false},
        {C, "{\"prompt\":\"a\",\"guided_json\":\"{\\\"type\\\":\\\"string\\\"}\"}", OAI_SO_JSON_SCHEMA, true, false},
        {C, "{\"prompt\":\"a\",\"guided_regex\":\"[0-9]+\"}", OAI_SO_REGEX, true, false},
        {C, "{\"prompt\":\"a\",\"guided_choice\":[\"yes\",\"no\"]}", OAI_SO_CHOICE, true, false},
        {C, "{\"prompt\":\"a\",\"guided_grammar\":\"root ::= \\\"x\\\"+\"}", OAI_SO_GRAMMAR, true, false},
        {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"choice\":[\"a\"]}}", OAI_SO_CHOICE, true, false},
        /* llama.cpp's extensions */
        {H, "%s\"response_format\":{\"type\":\"json_object\",\"schema\":{\"const\":\"42\"}}}", OAI_SO_JSON_SCHEMA, true, false},
        {H, "%s\"json_schema\":{\"items\":[{\"type\":\"integer\"}]}}", OAI_SO_JSON_SCHEMA, true, false},
        {H, "%s\"grammar\":\"root ::= \\\"a\\\"{5,5}\"}", OAI_SO_GRAMMAR, true, false},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}", OAI_SO_NONE, false, true},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"none\"}", OAI_SO_NONE, false, false},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"required\"}", OAI_SO_NONE, true, true},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}},\"parallel_tool_calls\":false}",
         OAI_SO_NONE, true, true},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"response_format\":{\"type\":\"json_object\"}}", OAI_SO_JSON_OBJECT, true, false},
    };
    const char *M = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],";
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        char body[1024];
        snprintf(body, sizeof body, ok[i].body, M);
        struct oai_request r;
        parse_ok(ok[i].kind, body, &r);
        assert_int_equal(r.so.kind, ok[i].so);
        struct oai_error e;
        if (oai_structured_compile(&r, GRAM_TOOLS_HERMES, &e)) fail_msg("case %zu: %s", i, e.message);
        assert_int_equal(r.so.grammar != NULL, ok[i].grammar);
        assert_int_equal(r.so.parse_tool_calls, ok[i].parse_tools);
        struct engine_request_params p;
        oai_engine_params(&r, (const int32_t[]){1}, 1, 64, &p);
        assert_ptr_equal(p.grammar, r.so.grammar);
        oai_request_free(&r);
    }
    struct { int kind; const char *body, *param, *want; } bad[] = {
        /* the param and the message name the exact value the user sent (F6) */
        {H, "%s\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":\"object\",\"patternProperties\":{}}}}}",
         "response_format.json_schema.schema", "response_format.json_schema.schema: unsupported JSON schema keyword 'patternProperties'"},
        {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"regex\":\"a(?=b)\"}}", "structured_outputs.regex",
         "structured_outputs.regex: lookahead"},
        {C, "{\"prompt\":\"a\",\"structured_outputs\":{\"json\":{\"type\":\"string\",\"format\":\"hostname\"}}}",
         "structured_outputs.json", "structured_outputs.json: "},
        /* pathological constraints are refused when compiled, naming the field and the limit (F2) */
        {C, "{\"prompt\":\"a\",\"guided_regex\":\"(.*a){1000}\"}", "guided_regex", "guided_regex: the constraint is too ambiguous"},
        {C, "{\"prompt\":\"a\",\"guided_grammar\":\"root ::= ([^x]* \\\"a\\\"){1,500}\"}", "guided_grammar", "more than 255 parses"},
        {C, "{\"prompt\":\"a\",\"guided_json\":{\"type\":\"string\",\"format\":\"hostname\"}}", "guided_json", "hostname"},
        {C, "{\"prompt\":\"a\",\"guided_regex\":\"(a)\\\\1\"}", "guided_regex", "backreference"},
        {H, "%s\"response_format\":{\"type\":\"json_object\",\"schema\":{\"type\":\"hiccup\"}}}", "response_format.schema", "hiccup"},
        {C, "{\"prompt\":\"a\",\"guided_grammar\":\"start ::= \\\"x\\\"\"}", "guided_grammar", "root"},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"not\":{}}}}],\"tool_choice\":\"required\"}",
         "tools", "'not'"},
        {H, "%s\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"required\",\"response_format\":{\"type\":\"json_object\"}}",
         "tool_choice", "response_format"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char body[1024];
        snprintf(body, sizeof body, bad[i].body, M);
        struct oai_request r;
        parse_ok(bad[i].kind, body, &r);
        struct oai_error e;
        assert_int_equal(oai_structured_compile(&r, GRAM_TOOLS_HERMES, &e), KV_EINVAL);
        if (e.status != 400 || strcmp(e.param, bad[i].param) || !strstr(e.message, bad[i].want))
            fail_msg("case %zu: %d param '%s' message '%s'", i, e.status, e.param, e.message);
        oai_request_free(&r);
    }
}

/* Thousands of alternatives compile (a trie: tester finding F5); past the limit the 400 names
 * the field and the limit. */
static void test_many_choices(void **state) {
    (void)state;
    for (int over = 0; over < 2; over++) {
        int n = over ? 65537 : 4000;
        kv_buf b;
        kv_buf_init(&b);
        kv_buf_puts(&b, over ? "{\"prompt\":\"a\",\"guided_choice\":[" : "{\"prompt\":\"a\",\"guided_json\":{\"enum\":[");
        for (int i = 0; i < n; i++) kv_buf_printf(&b, "%s\"choice number %d\"", i ? "," : "", i);
        kv_buf_puts(&b, over ? "]}" : "]}}");
        struct oai_request r;
        parse_ok(C, kv_buf_cstr(&b), &r);
        struct oai_error e;
        kv_status st = oai_structured_compile(&r, GRAM_TOOLS_HERMES, &e);
        if (!over) {
            if (st) fail_msg("%s", e.message);
            assert_non_null(r.so.grammar);
        } else {
            assert_int_equal(st, KV_EINVAL);
            assert_int_equal(e.status, 400);
            assert_string_equal(e.param, "guided_choice");
            assert_string_equal(e.message, "guided_choice: 65537 choices: the limit is 65536");
        }
        oai_request_free(&r);
        kv_buf_free(&b);
    }
}

/* Tool-call markers that a vocabulary makes special tokens (absent from the output text) are
 * recognized for re-insertion; ordinary tokens and markers of other formats are not. */
static void test_tool_markers(void **state) {
    (void)state;
    char dir[128], path[256];
    assert_int_equal(test_tmpdir_make(dir, sizeof dir, "kv_markers"), 0);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"version\":\"1.0\",\"added_tokens\":["
          "{\"id\":3,\"content\":\"[TOOL_CALLS]\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true},"
          "{\"id\":4,\"content\":\"<tool_call>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true},"
          "{\"id\":5,\"content\":\"</tool_call>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":false}],"
          "\"normalizer\":null,\"pre_tokenizer\":null,\"post_processor\":null,\"decoder\":null,"
          "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"[TOOL_CALLS]\":3,\"<tool_call>\":4,"
          "\"</tool_call>\":5},\"merges\":[]}}", f);
    fclose(f);
    tokenizer_t *t = NULL;
    char err[256];
    if (tok_load(path, &t, err, sizeof err)) fail_msg("%s", err);
    assert_string_equal(tools_marker_text(t, GRAM_TOOLS_MISTRAL, 3), "[TOOL_CALLS]");
    assert_null(tools_marker_text(t, GRAM_TOOLS_HERMES, 3));      /* not a hermes marker */
    assert_string_equal(tools_marker_text(t, GRAM_TOOLS_HERMES, 4), "<tool_call>");
    assert_null(tools_marker_text(t, GRAM_TOOLS_HERMES, 5));      /* not special: already in the text */
    assert_null(tools_marker_text(t, GRAM_TOOLS_MISTRAL, 0));
    assert_null(tools_marker_text(t, GRAM_TOOLS_MISTRAL, -1));
    tok_free(t);
    test_tmpdir_remove(dir);
}

static void test_disaggregated_params(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"generation_only\","
                "\"disagg_request_id\":9007199254740991,\"ctx_request_id\":4,\"schedule_style\":"
                "\"context_first\",\"first_gen_tokens\":[7],\"ctx_info_endpoint\":[\"127.0.0.1:9\"],"
                "\"prompt_token_ids\":[1,2,3],\"first_gen_logprobs\":{\"id\":7,\"logprob\":-0.5,"
                "\"top\":[[7,-0.5],[8,-1.5]]},\"pool\":{},\"conversation_id\":\"c1\"}}", &r);
    assert_int_equal(r.disagg.type, OAI_DISAGG_GENERATION_ONLY);
    assert_true(r.disagg.disagg_id == 9007199254740991ull);
    assert_true(r.disagg.has_ctx_id);
    assert_true(r.disagg.context_first);
    assert_int_equal(r.disagg.n_first, 1);
    assert_int_equal(r.disagg.first[0], 7);
    assert_string_equal(r.disagg.endpoint, "127.0.0.1:9");
    assert_int_equal(r.disagg.n_prompt_ids, 3);
    assert_int_equal(r.disagg.prompt_ids[2], 3);
    assert_true(r.disagg.has_first_lp);
    assert_int_equal(r.disagg.n_first_top, 2);
    assert_int_equal(r.disagg.first_top[1].id, 8);
    assert_string_equal(r.disagg.conversation_id, "c1");
    struct engine_request_params p;
    oai_engine_params(&r, r.disagg.prompt_ids, r.disagg.n_prompt_ids, 512, &p);
    assert_int_equal(p.disagg, ENGINE_DISAGG_GENERATION_ONLY);
    assert_int_equal(p.n_first, 1);
    assert_non_null(p.first_logprob);
    assert_string_equal(p.peer_endpoint, "127.0.0.1:9");
    oai_request_free(&r);
    /* generation first: no first token, the schedule style flips */
    parse_ok(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":true,"
                "\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":3,"
                "\"schedule_style\":\"generation_first\",\"ctx_info_endpoint\":\"h:2\"}}", &r);
    assert_false(r.disagg.context_first);
    assert_int_equal(r.disagg.n_first, 0);
    oai_request_free(&r);
    parse_ok(C, "{\"prompt\":\"a\",\"disaggregated_params\":{\"request_type\":\"context_only\","
                "\"disagg_request_id\":5}}", &r);
    assert_int_equal(r.disagg.type, OAI_DISAGG_CONTEXT_ONLY);
    oai_engine_params(&r, (const int32_t[]){1}, 1, 512, &p);
    assert_int_equal(p.disagg, ENGINE_DISAGG_CONTEXT_ONLY);
    assert_true(p.disagg_id == 5);
    oai_request_free(&r);
}

static void test_tokenize_detokenize(void **state) {
    (void)state;
    struct oai_request r;
    parse_ok(T, "{\"prompt\":\"hello\",\"add_special_tokens\":false}", &r);
    assert_string_equal(r.text, "hello");
    assert_false(r.add_special);
    oai_request_free(&r);
    parse_ok(T, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r);
    assert_int_equal(json_array_size(r.chat_msgs), 1);
    assert_true(r.add_special);
    oai_request_free(&r);
    /* a tokenize id prompt longer than max_model_len is fine (no generation) */
    {
        kv_buf b;
        kv_buf_init(&b);
        kv_buf_puts(&b, "{\"prompt\":[1");
        for (int i = 0; i < 600; i++) kv_buf_puts(&b, ",5");
        kv_buf_puts(&b, "]}");
        parse_ok(T, b.data, &r);
        assert_int_equal(r.n_ids, 601);
        oai_request_free(&r);
        kv_buf_free(&b);
    }
    parse_ok(D, "{\"tokens\":[1, 511, 0]}", &r);
    assert_int_equal(r.n_ids, 3);
    assert_int_equal(r.ids[1], 511);
    oai_request_free(&r);
    parse_ok(D, "{\"tokens\":[]}", &r);
    assert_int_equal(r.n_ids, 0);
    oai_request_free(&r);
}

static void test_responses_shapes(void **state) {
    (void)state;
    struct resp_meta m = {"cmpl-abc", 1700000000, "stories260K", OAI_COMPLETION, 0};
    struct resp_usage u = {5, 3, 0};
    char *s = resp_full_json(&m, "Hi \"x\"", 6, NULL, "length", &u);
    assert_non_null(s);
    assert_string_equal(s, "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1700000000,"
                           "\"model\":\"stories260K\",\"choices\":[{\"index\":0,\"text\":\"Hi \\\"x\\\"\","
                           "\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":5,"
                           "\"completion_tokens\":3,\"total_tokens\":8,\"prompt_tokens_details\":"
                           "{\"cached_tokens\":0}}}");
    free(s);
    kv_buf b;
    kv_buf_init(&b);
    m.kind = OAI_CHAT;
    m.id = "chatcmpl-1";
    assert_int_equal(resp_chunk_sse(&b, &m, "assistant", "", 0, NULL, NULL), KV_OK);
    assert_string_equal(kv_buf_cstr(&b),
                        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":"
                        "1700000000,\"model\":\"stories260K\",\"choices\":[{\"index\":0,\"delta\":"
                        "{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":"
                        "null}]}\n\n");
    b.len = 0;
    assert_int_equal(resp_usage_sse(&b, &m, &u), KV_OK);
    assert_non_null(strstr(kv_buf_cstr(&b), "\"choices\":[],\"usage\":{\"prompt_tokens\":5"));
    kv_buf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_prompt_too_long_ids),
        cmocka_unit_test(test_completion_defaults),
        cmocka_unit_test(test_completion_full),
        cmocka_unit_test(test_completion_token_prompt),
        cmocka_unit_test(test_sampling_fields),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_chat_tools),
        cmocka_unit_test(test_structured),
        cmocka_unit_test(test_many_choices),
        cmocka_unit_test(test_tool_markers),
        cmocka_unit_test(test_disaggregated_params),
        cmocka_unit_test(test_tokenize_detokenize),
        cmocka_unit_test(test_responses_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
