/* libFuzzer target: the Jinja interpreter (src/tokenizer/jinja/) on an arbitrary template,
 * rendered with a fixed chat context (messages with tool calls, tools, flags) as a chat
 * template is. Syntax errors, unsupported constructs, raise_exception and the step / depth /
 * output limits are errors; crashes, leaks and hangs are not. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tokenizer/jinja/jinja.h"

static json_t *g_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    g_ctx = json_loads(
        "{\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":\"hi \\u00e9 <|x|>\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"type\":\"function\","
        "\"function\":{\"name\":\"f\",\"arguments\":{\"a\":1,\"b\":[1,2.5,\"s\"]}}}]},"
        "{\"role\":\"tool\",\"content\":\"42\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"part\"}]}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}],"
        "\"add_generation_prompt\":true,\"bos_token\":\"<s>\",\"eos_token\":\"</s>\","
        "\"enable_thinking\":false}",
        0, NULL);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    jinja_template_t *t = NULL;
    char err[512];
    if (jinja_parse((const char *)data, size, &t, err, sizeof err) != KV_OK) return 0;
    char *out = NULL;
    size_t n = 0;
    if (jinja_render(t, g_ctx, &out, &n, err, sizeof err) == KV_OK) {
        if (strlen(out) > n) abort(); /* NUL-terminated at n */
        free(out);
    }
    jinja_free(t);
    return 0;
}
