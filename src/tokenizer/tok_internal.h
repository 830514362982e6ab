/*
 * tok_internal: the tokenizer's private data model, shared by its translation units.
 *
 * Both sources (HF tokenizer.json, GGUF metadata) are lowered to one pipeline, the same
 * one HF tokenizers runs:
 *
 *   text --added-token split--> segments --normalizer--> --pre-tokenizer--> words
 *        --model (BPE by rank | BPE by score)--> ids --post-processor (BOS...)--> ids
 *   ids --token strings--> decoder chain (ByteLevel | Replace, ByteFallback, Fuse, Strip,
 *        Metaspace) --> lossy UTF-8 --> text
 *
 * Strings in the vocabulary are stored in one arena (owned by the tokenizer).
 */
#ifndef KV_TOK_INTERNAL_H
#define KV_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "tokenizer.h"

/* token flags */
enum {
    TF_MODEL = 1,   /* in the model's vocabulary (BPE lookups see it) */
    TF_ADDED = 2,   /* an added token (matched on the raw text before the model) */
    TF_SPECIAL = 4, /* special: skipped by decode(skip_special), parse_special controls it */
    TF_BYTE = 8,    /* byte-fallback token <0xXX>; t->tok_byte[id] is the byte */
};

struct tok_entry {
    const char *s; /* arena, NUL-terminated */
    uint32_t len;
    float score;   /* SPM score (GGUF llama); 0 otherwise */
    uint8_t flags;
    uint8_t byte;  /* for TF_BYTE */
};

struct added_token {
    int id;
    const char *s; /* = vocab[id].s */
    uint32_t len;
    bool special, lstrip, rstrip, single_word, normalized;
};

/* ---- string -> id hash (keys are the vocab strings themselves) ---- */
struct strmap {
    int32_t *slots; /* id or -1 */
    uint32_t mask;
};

/* ---- pair (left id, right id) -> (rank, merged id) ---- */
struct pairmap {
    uint64_t *keys; /* (left << 32 | right) + 1; 0 = empty */
    int32_t *rank;
    int32_t *merged;
    uint32_t mask;
};

enum norm_kind { N_NFC, N_NFD, N_NFKC, N_NFKD, N_LOWERCASE, N_PREPEND, N_REPLACE, N_STRIP };
struct norm_step {
    enum norm_kind kind;
    char *a; size_t alen;   /* Prepend text / Replace pattern string */
    char *b; size_t blen;   /* Replace content */
    pcre2_code *re;         /* Replace with a Regex pattern */
    bool left, right;       /* Strip */
};

enum pre_kind { P_SPLIT, P_BYTELEVEL, P_METASPACE, P_DIGITS };
enum split_behavior { SB_ISOLATED, SB_REMOVED, SB_MERGED_PREV, SB_MERGED_NEXT, SB_CONTIGUOUS };
struct pre_step {
    enum pre_kind kind;
    pcre2_code *re;             /* Split (pattern), ByteLevel (use_regex) */
    char *lit; size_t litlen;   /* Split with a String pattern */
    enum split_behavior behavior;
    bool invert;
    bool add_prefix_space;      /* ByteLevel */
    char repl[8]; size_t repl_len; /* Metaspace replacement */
    int prepend;                /* Metaspace: 0 never, 1 first, 2 always */
    bool split;                 /* Metaspace split */
    bool individual_digits;     /* Digits */
};

enum dec_kind { D_BYTELEVEL, D_REPLACE, D_BYTEFALLBACK, D_FUSE, D_STRIP, D_METASPACE };
struct dec_step {
    enum dec_kind kind;
    char *a; size_t alen; /* Replace pattern, Strip content, Metaspace replacement */
    char *b; size_t blen; /* Replace content */
    int start, stop;      /* Strip */
    bool prepend;         /* Metaspace: strip the leading space of the first token */
};

enum model_kind { M_BPE_RANK, M_BPE_SCORE };

struct tokenizer {
    enum model_kind model;
    struct tok_entry *tok; /* [n_tok] */
    int n_tok;
    char *arena; size_t arena_len, arena_cap; /* vocab strings; pointers fixed after load */
    struct strmap vmap;
    struct pairmap merges;
    bool byte_fallback, ignore_merges, fuse_unk;
    int unk;
    int byte_tok[256]; /* id of <0xXX> or -1 */

    struct added_token *added; int n_added;
    /* added tokens by first byte: indices into added[] for byte b are
     * added_idx[added_first[b] .. added_first[b + 1]), in added[] order (longest first) */
    int32_t *added_idx; int32_t added_first[257];
    struct norm_step *norm; int n_norm;
    struct pre_step *pre; int n_pre;
    struct dec_step *dec; int n_dec;
    bool bytelevel_input; /* a ByteLevel pre-tokenizer maps bytes to chars */
    /* No model token holds U+2581 after another character (Llama-2/Mistral vocabularies): no
     * merge can cross the start of a "\u2581" run, so words are split there before BPE,
     * with the same result and much smaller merge queues. */
    bool spm_split;

    /* post-processor: ids around the sequence when add_special */
    int32_t prefix_ids[4]; int n_prefix;
    int32_t suffix_ids[4]; int n_suffix;

    bool strings_resolved; /* tok[].s are pointers and vmap is built */
    int bos, eos, eot;
    bool add_bos;
    uint8_t *eog; /* [n_tok] */
    char *chat_template; /* owned or NULL */
    chat_format chat_fmt;
    bool chat_qwen_think; /* ChatML template that strips <think> blocks of old turns */
    bool chat_gen_always;  /* template emits the generation prompt unconditionally (Llama-3 8B) */
    bool chat_llama2_sys;  /* [INST] template with <<SYS>> blocks (Llama-2-chat) */
};

/* tokenizer.c */
kv_status tok_vocab_alloc(tokenizer_t *t, int n_tok);
/* Sets vocab string of id (copied into the arena). */
kv_status tok_vocab_set(tokenizer_t *t, int id, const char *s, size_t len);
/* Builds the hash, byte table, eog set, added-token table order; call after filling. */
kv_status tok_finalize(tokenizer_t *t, char *err, size_t errlen);
/* Resolves the vocab strings and builds the string hash (no more tok_vocab_set after). */
kv_status tok_finalize_map_only(tokenizer_t *t);
int tok_lookup(const tokenizer_t *t, const char *s, size_t len); /* any token */
/* The byte of a byte-fallback token "<0xHH>" (s[0..n), exactly two hex digits, any case), or
 * -1 when s is not one. */
int tok_parse_byte_token(const char *s, size_t n);
kv_status pairmap_put(struct pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged);
kv_status pairmap_init(struct pairmap *m, size_t n);
/* Compiles a HF/llama.cpp pre-tokenizer regex (UTF + UCP, JIT when available) with \s, \S,
 * \p{L}, \p{N}, \p{P} rewritten to HF's (Oniguruma, Unicode 16) classes. NULL + err on error. */
pcre2_code *tok_regex_compile(const char *pat, size_t len, char *err, size_t errlen);
/* Numeric code points (Unicode 16) that this utf8proc/PCRE2 does not classify as N*. */
bool tok_cp_extra_numeric(int32_t cp);

/* ---- UTF-8 helpers shared by tok_encode.c and tok_pretok.c ---- */

/* Length in bytes of the UTF-8 character at p (n >= 1 bytes available); 1 for an invalid
 * or truncated sequence, so that callers step over one invalid byte at a time. */
static inline size_t tok_u8len(const char *p, size_t n) {
    int l = kv_utf8_seq_len((unsigned char)p[0]);
    if (l <= 1 || (size_t)l > n) return 1;
    return kv_utf8_valid(p, (size_t)l) ? (size_t)l : 1;
}

/* Code point of the l-byte character at p (as measured by tok_u8len); -1 if invalid. */
static inline int32_t tok_u8decode(const char *p, size_t l) {
    utf8proc_int32_t cp = -1;
    utf8proc_iterate((const utf8proc_uint8_t *)p, (utf8proc_ssize_t)l, &cp);
    return cp;
}

/* HF/Rust char::is_whitespace: ASCII 9..13, space, U+0085 and categories Zs, Zl, Zp. */
static inline bool tok_cp_is_space(int32_t cp) {
    if (cp == ' ' || (cp >= 9 && cp <= 13)) return true;
    if (cp < 128) return false;
    utf8proc_category_t c = utf8proc_category(cp);
    return cp == 0x85 || c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL ||
           c == UTF8PROC_CATEGORY_ZP;
}

/* ---- tok_pretok.c: byte-level table, normalizers, pre-tokenizers ---- */

/* Pieces: spans of one owned buffer (the words a pre-tokenizer produces). */
struct tok_span {
    size_t off, len; /* bytes, into buf */
    bool first; /* starts at the beginning of the input text (Metaspace prepend_scheme=first) */
};
typedef struct {
    kv_buf buf;
    struct tok_span *s; /* [n], owned */
    size_t n, cap;
} tok_pieces;

/* Frees p's buffer and spans (p itself is the caller's). */
void tok_pieces_free(tok_pieces *p);

/* Builds the GPT-2 byte<->char tables once (thread-safe, idempotent). */
void tok_bytelevel_init(void);
/* *dec = the table codepoint (< 512) -> byte, -1 where not a byte-level char; initializes it. */
void tok_bytelevel_tables(const int16_t **dec);

/* Runs t's normalizer chain over s[0..n) into out (out is reset first; owned by the caller).
 * Errors: KV_ENOMEM, KV_EINTERNAL (regex failure); out then holds unspecified bytes. */
kv_status tok_normalize(const tokenizer_t *t, const char *s, size_t n, kv_buf *out);

/* Runs t's pre-tokenizer chain over the (normalized) segment s[0..n); first: the segment
 * starts the input text. *out is overwritten (need not be initialized) with the words, in
 * order; the caller frees it with tok_pieces_free, after a failure too. Requires
 * tok_bytelevel_init() to have run. Errors: KV_ENOMEM, KV_EINTERNAL (regex failure). */
kv_status tok_pretokenize(const tokenizer_t *t, const char *s, size_t n, bool first, tok_pieces *out);

/* loaders */
kv_status tok_load_json(tokenizer_t *t, const char *json_path, const char *config_path, char *err,
                        size_t errlen);
kv_status tok_load_gguf(tokenizer_t *t, const char *path, char *err, size_t errlen);
/* Pre-tokenizer regexes llama.cpp uses for tokenizer.ggml.pre values (NULL if unknown). */

/* chat.c: detects the family from the template text. */
void tok_chat_detect(tokenizer_t *t);

#endif
