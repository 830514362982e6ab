#!/usr/bin/env python3
"""Writes the fuzz targets' generated seeds into DIR/seeds/TARGET (tests/fuzz/run.sh calls it):
model and tokenizer files are never tracked in the repository, so the GGUF seed is built here
byte by byte and the tokenizer.json seeds from the dicts below (three small BPE tokenizers:
byte-level with NFC, Metaspace, digits + lowercase), plus stories260K's tokenizer.json from
$KVSERVE_TEST_DATA when it is there.

  make_seeds.py DIR TARGET
"""
import json
import os
import shutil
import struct
import sys

TOKENIZERS = {'bpe_bytelevel': {'version': '1.0',
                   'added_tokens': [{'id': 0,
                                     'content': '<s>',
                                     'special': True,
                                     'single_word': False,
                                     'lstrip': False,
                                     'rstrip': False,
                                     'normalized': False},
                                    {'id': 1,
                                     'content': '</s>',
                                     'special': True,
                                     'single_word': False,
                                     'lstrip': False,
                                     'rstrip': False,
                                     'normalized': False}],
                   'normalizer': {'type': 'NFC'},
                   'pre_tokenizer': {'type': 'Sequence',
                                     'pretokenizers': [{'type': 'Split',
                                                        'pattern': {'Regex': "'s|'t| ?\\p{L}+| "
                                                                             '?\\p{N}+| '
                                                                             '?[^\\s\\p{L}\\p{N}]+|\\s+'},
                                                        'behavior': 'Isolated',
                                                        'invert': False},
                                                       {'type': 'ByteLevel',
                                                        'add_prefix_space': False,
                                                        'trim_offsets': True,
                                                        'use_regex': False}]},
                   'post_processor': {'type': 'TemplateProcessing',
                                      'single': [{'SpecialToken': {'id': '<s>', 'type_id': 0}},
                                                 {'Sequence': {'id': 'A', 'type_id': 0}}],
                                      'pair': [{'Sequence': {'id': 'A', 'type_id': 0}}],
                                      'special_tokens': {'<s>': {'id': '<s>',
                                                                 'ids': [0],
                                                                 'tokens': ['<s>']}}},
                   'decoder': {'type': 'ByteLevel',
                               'add_prefix_space': True,
                               'trim_offsets': True,
                               'use_regex': True},
                   'model': {'type': 'BPE',
                             'dropout': None,
                             'unk_token': None,
                             'continuing_subword_prefix': None,
                             'end_of_word_suffix': None,
                             'fuse_unk': False,
                             'byte_fallback': False,
                             'ignore_merges': False,
                             'vocab': {'<s>': 0,
                                       '</s>': 1,
                                       'H': 2,
                                       'e': 3,
                                       'l': 4,
                                       'o': 5,
                                       'Ġ': 6,
                                       'w': 7,
                                       'r': 8,
                                       'd': 9,
                                       'He': 10,
                                       'll': 11,
                                       'Hell': 12,
                                       'Hello': 13,
                                       'Ġw': 14,
                                       'or': 15,
                                       'Ġwor': 16,
                                       'ld': 17,
                                       'Ġworld': 18,
                                       ',': 19,
                                       '!': 20,
                                       '1': 21,
                                       '2': 22,
                                       '3': 23},
                             'merges': ['H e',
                                        'l l',
                                        'He ll',
                                        'Hell o',
                                        'Ġ w',
                                        'o r',
                                        'Ġw or',
                                        'l d',
                                        'Ġwor ld']}},
 'bpe_metaspace': {'version': '1.0',
                   'added_tokens': [{'id': 0, 'content': '<unk>', 'special': True},
                                    {'id': 1, 'content': '<s>', 'special': True},
                                    {'id': 2, 'content': '</s>', 'special': True}],
                   'normalizer': {'type': 'Sequence',
                                  'normalizers': [{'type': 'Prepend', 'prepend': '▁'},
                                                  {'type': 'Replace',
                                                   'pattern': {'String': ' '},
                                                   'content': '▁'}]},
                   'pre_tokenizer': None,
                   'post_processor': {'type': 'TemplateProcessing',
                                      'single': [{'SpecialToken': {'id': '<s>', 'type_id': 0}},
                                                 {'Sequence': {'id': 'A', 'type_id': 0}}],
                                      'pair': [],
                                      'special_tokens': {'<s>': {'id': '<s>',
                                                                 'ids': [1],
                                                                 'tokens': ['<s>']}}},
                   'decoder': {'type': 'Sequence',
                               'decoders': [{'type': 'Replace',
                                             'pattern': {'String': '▁'},
                                             'content': ' '},
                                            {'type': 'ByteFallback'},
                                            {'type': 'Fuse'},
                                            {'type': 'Strip',
                                             'content': ' ',
                                             'start': 1,
                                             'stop': 0}]},
                   'model': {'type': 'BPE',
                             'unk_token': '<unk>',
                             'fuse_unk': True,
                             'byte_fallback': True,
                             'vocab': {'<unk>': 0,
                                       '<s>': 1,
                                       '</s>': 2,
                                       '<0x0A>': 3,
                                       '<0x48>': 4,
                                       '▁': 5,
                                       'H': 6,
                                       'e': 7,
                                       'l': 8,
                                       'o': 9,
                                       '▁H': 10,
                                       'll': 11,
                                       '▁He': 12,
                                       '▁Hell': 13,
                                       '▁Hello': 14},
                             'merges': [['▁', 'H'],
                                        ['l', 'l'],
                                        ['▁H', 'e'],
                                        ['▁He', 'll'],
                                        ['▁Hell', 'o']]}},
 'digits_lower': {'added_tokens': [],
                  'normalizer': {'type': 'Sequence',
                                 'normalizers': [{'type': 'NFKC'},
                                                 {'type': 'Lowercase'},
                                                 {'type': 'Strip',
                                                  'strip_left': True,
                                                  'strip_right': True}]},
                  'pre_tokenizer': {'type': 'Sequence',
                                    'pretokenizers': [{'type': 'Digits', 'individual_digits': True},
                                                      {'type': 'Metaspace',
                                                       'replacement': '▁',
                                                       'prepend_scheme': 'first',
                                                       'split': True}]},
                  'decoder': {'type': 'Metaspace',
                              'replacement': '▁',
                              'prepend_scheme': 'always',
                              'split': True},
                  'model': {'type': 'BPE',
                            'vocab': {'▁': 0, 'a': 1, 'b': 2, '1': 3, '2': 4, 'ab': 5},
                            'merges': ['a b']}}}


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def tiny_gguf():
    """GGUF v3: llama architecture, 1 block, rope base, a 4-token vocabulary with scores and
    types, one 2x4 f32 tensor (t.weight) aligned to 32 bytes."""
    kv = [gstr("general.architecture") + struct.pack("<I", 8) + gstr("llama"),
          gstr("llama.block_count") + struct.pack("<II", 4, 1),
          gstr("llama.rope.freq_base") + struct.pack("<If", 6, 10000.0),
          gstr("b") + struct.pack("<IB", 7, 1),
          gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 4) + b"".join(gstr(t) for t in ["<s>", "</s>", "a", "b"]),
          gstr("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 4) + struct.pack("<4f", 0.0, 0.0, -1.0, -2.0),
          gstr("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, 4) + struct.pack("<4i", 3, 3, 1, 1)]
    tensors = gstr("t.weight") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv)) + b"".join(kv) + tensors
    head += b"\0" * (-len(head) % 32)
    return head + struct.pack("<8f", *[float(i) for i in range(1, 9)])


def main():
    out, target = sys.argv[1], sys.argv[2]
    d = os.path.join(out, "seeds", target)
    os.makedirs(d, exist_ok=True)
    if target == "gguf":
        with open(os.path.join(d, "tiny.gguf"), "wb") as f:
            f.write(tiny_gguf())
    elif target == "tokenizer_json":
        for name, tok in TOKENIZERS.items():
            with open(os.path.join(d, name + ".json"), "w") as f:
                json.dump(tok, f)
        data = os.environ.get("KVSERVE_TEST_DATA", os.path.join(os.path.dirname(__file__), "../../../shared/data"))
        stories = os.path.join(data, "models/stories260K/hf/tokenizer.json")
        if os.path.isfile(stories):
            shutil.copy(stories, os.path.join(d, "stories260K.json"))


if __name__ == "__main__":
    main()
