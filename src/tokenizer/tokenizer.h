/*
 * tokenizer: vocabularies and encoders that produce the ids a model expects, decoders,
 * the incremental (streaming) detokenizer, and chat-template rendering.
 *
 * Sources:
 *   - GGUF metadata: tokenizer.ggml.model = "llama" (SentencePiece-style BPE with scores and
 *     byte fallback <0xXX>) or "gpt2" (byte-level BPE with merges), tokenizer.ggml.pre names the
 *     pre-tokenizer regex, token_type marks control/user-defined/byte tokens.
 *   - Hugging Face tokenizer.json (+ tokenizer_config.json for BOS/EOS flags and chat_template):
 *     BPE model, byte-level (GPT-2/Llama-3/Qwen) or SPM-style with byte_fallback (Llama-2/Mistral).
 *
 * Example:
 *   tokenizer_t *t; char err[256];
 *   tok_load("model.gguf", &t, err, sizeof err);
 *   int32_t *ids; size_t n;
 *   tok_encode(t, "Hello", 5, true, false, &ids, &n);   // BOS + ids, caller frees ids
 *   char *s; size_t len; tok_decode(t, ids, n, true, &s, &len); free(s);
 *   tok_free(t);
 *
 * Thread safety: a loaded tokenizer is immutable; encode/decode may run on any number of
 * threads at once. A tok_stream_t belongs to one request (one thread at a time).
 */
#ifndef KV_TOKENIZER_H
#define KV_TOKENIZER_H

#include "../base/base.h"

typedef struct tokenizer tokenizer_t;

/* path: a GGUF file, a tokenizer.json file, or a directory holding tokenizer.json
 * (and optionally tokenizer_config.json). Errors name the file and the problem. */
kv_status tok_load(const char *path, tokenizer_t **out, char *err, size_t errlen);
void tok_free(tokenizer_t *t);

int tok_n_vocab(const tokenizer_t *t);
int tok_bos(const tokenizer_t *t);        /* -1 if none */
int tok_eos(const tokenizer_t *t);        /* -1 if none */
bool tok_add_bos(const tokenizer_t *t);   /* whether prompts get BOS by default */
/* True for control/special tokens (BOS, EOS, <|im_end|>, ...). */
bool tok_is_special(const tokenizer_t *t, int id);
/* True for end-of-generation tokens (EOS, <|eot_id|>, <|im_end|>, <|end_of_text|> ...). */
bool tok_is_eog(const tokenizer_t *t, int id);
/* The vocabulary string of a token (borrowed; raw form, e.g. "▁the" or "Ġthe"). NULL if out
 * of range. */
const char *tok_token_str(const tokenizer_t *t, int id);
/* Finds the id of an exact vocabulary/added-token string, -1 if absent. */
int tok_find(const tokenizer_t *t, const char *s);
/* True when the tokenizer has a BOS token and text[0..len) begins with its string (e.g. a
 * rendered Llama-3 chat prompt starting with "<|begin_of_text|>"). */
bool tok_text_starts_with_bos(const tokenizer_t *t, const char *text, size_t len);

/* Encodes text[0..len) (UTF-8; invalid bytes are encoded through byte fallback or
 * byte-level mapping, never dropped). add_special: prepend BOS (and whatever the
 * post-processor adds) when the tokenizer uses it, exactly as HF tokenizers does (text that
 * itself starts with the BOS token gets a second one: see tok_text_starts_with_bos for the
 * chat rule). parse_special: text like "<|im_end|>" or "<s>" becomes the special token
 * (otherwise it is encoded as plain text); non-special added tokens always match.
 * *ids is heap-allocated (caller frees); KV_ENOMEM on failure with *ids untouched. */
kv_status tok_encode(const tokenizer_t *t, const char *text, size_t len, bool add_special,
                     bool parse_special, int32_t **ids, size_t *n_ids);

/* Decodes ids to UTF-8 like HF decode(): byte-fallback tokens are joined into bytes,
 * Metaspace "▁" becomes a space (the leading space of the very first token is removed
 * when the tokenizer adds a prefix space), byte-level symbols map back to bytes.
 * skip_special drops control tokens. Invalid UTF-8 in the result is replaced by U+FFFD.
 * Ids out of range give KV_EINVAL. *out is heap-allocated and NUL-terminated. */
kv_status tok_decode(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                     char **out, size_t *out_len);

/* The raw bytes one token contributes when it follows other tokens (no leading-space
 * removal, no UTF-8 repair). Written into buf (up to cap bytes); returns the length or -1. */
int tok_token_bytes(const tokenizer_t *t, int id, char *buf, size_t cap);

/* ---- incremental detokenizer for streaming ----
 * Feed generated ids one at a time; each push returns the text that is now final.
 * Guarantees: never emits a partial UTF-8 character; no text of the prompt ever appears;
 * the concatenation of all emitted text plus tok_stream_flush() equals the one-shot decode
 * of the generated ids (skip_special = true) in the stream's mode:
 *   - n_prompt > 0 (the server's case): the generated ids are decoded as a continuation of
 *     the prompt, so the leading space of the first generated SPM token ("\u2581was" ->
 *     " was") is kept. This is the completion text llama.cpp returns (the reference outputs in
 *     shared/data keep it); prompt_ids themselves never contribute text.
 *   - n_prompt == 0: equals tok_decode(generated ids), which drops that leading space as HF
 *     decode() does for a standalone sequence.
 * Text is held back while it ends in an incomplete UTF-8 character or a run of
 * byte-fallback tokens <0xXX> that may continue. */
typedef struct tok_stream tok_stream_t;
tok_stream_t *tok_stream_new(const tokenizer_t *t, const int32_t *prompt_ids, size_t n_prompt);
void tok_stream_free(tok_stream_t *s);
/* Appends the newly final text to out. */
kv_status tok_stream_push(tok_stream_t *s, int32_t id, kv_buf *out);
/* Appends whatever is held back (incomplete UTF-8 is replaced by U+FFFD). */
kv_status tok_stream_flush(tok_stream_t *s, kv_buf *out);

/* ---- chat templates ----
 * Rendering uses the model's own chat_template (tokenizer_config.json "chat_template" or
 * GGUF "tokenizer.chat_template"), run by the Jinja interpreter in jinja/ (output
 * byte-identical to Hugging Face's @huggingface/jinja; supported subset in
 * docs/chat-templates.md). The template sees messages, add_generation_prompt, bos_token and
 * eos_token (the tokenizer's BOS/EOS strings, null when it has none) plus any kwargs.
 * A model without a template gets ChatML, as llama.cpp does; a template the interpreter
 * cannot parse falls back to the built-in family renderers (ChatML, Llama-3, Mistral/Llama-2
 * [INST], detected by markers) with a warning logged at load.
 * The output is exactly the template's text, including a BOS string when the template
 * writes one (Llama-3 "<|begin_of_text|>", Llama-2/Mistral "<s>"); ChatML writes none.
 * It is then tokenized with parse_special = true and add_special = tok_add_bos(t) &&
 * !tok_text_starts_with_bos(t, text, len): exactly one BOS, as llama.cpp does (HF's
 * apply_chat_template tokenizes with add_special_tokens=False and relies on the template). */
struct chat_message {
    const char *role;    /* "system" | "user" | "assistant" | "tool" ... (borrowed) */
    const char *content; /* borrowed UTF-8 */
};
typedef enum { CHAT_FMT_CHATML = 0, CHAT_FMT_LLAMA3, CHAT_FMT_MISTRAL } chat_format;
chat_format tok_chat_format(const tokenizer_t *t);
/* The model's chat template source (borrowed), or NULL when it has none. */
const char *tok_chat_template(const tokenizer_t *t);
const char *chat_format_name(chat_format f);
/* tok_chat_format: the built-in family detected from the template text (used only when the
 * template itself cannot be run; ChatML without a template). */
/* Renders; *out heap-allocated, NUL-terminated. KV_EINVAL (message in err) for an empty
 * list, a template error (e.g. raise_exception("Conversation roles must alternate ..."),
 * with the template's line/column) or a role the built-in format cannot express;
 * KV_ETOOLONG if the template exceeds the interpreter's limits. *out untouched on error. */
kv_status tok_chat_render(const tokenizer_t *t, const struct chat_message *msgs, size_t n,
                          bool add_generation_prompt, char **out, char *err, size_t errlen);

/* The richer variant: messages is a JSON array (jansson) of message objects as the OpenAI
 * API sends them (content may be null or a list of parts, tool_calls, tool_call_id,
 * reasoning_content ...), passed to the template unchanged. kwargs (NULL or a JSON object)
 * adds template variables such as "tools" (a list) or "enable_thinking" (bool). Without a
 * usable template, messages must be plain role/content strings (built-in renderer).
 * Errors as tok_chat_render. The JSON values are borrowed. */
struct json_t;
kv_status tok_chat_render_json(const tokenizer_t *t, const struct json_t *messages, const struct json_t *kwargs,
                               bool add_generation_prompt, char **out, char *err, size_t errlen);

/* Renders template_src directly, without a tokenizer (bos/eos: strings or NULL -> null).
 * Parse errors name the line/column of the template. Errors as tok_chat_render. */
kv_status tok_chat_render_template(const char *template_src, const char *bos, const char *eos,
                                   const struct json_t *messages, const struct json_t *kwargs,
                                   bool add_generation_prompt, char **out, char *err, size_t errlen);

#endif
