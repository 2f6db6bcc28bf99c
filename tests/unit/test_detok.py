"""Streaming text: held back while it may change, cut at stop strings.

Uses a stand-in tokenizer (token id → fixed string, U+FFFD for a half character)
because the logic under test is the streaming, not a vocabulary.
"""

from cosine.router.detok import StreamText


class CharTokenizer:
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\ufffd", 7: "END", 8: "x"}

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids)
        return text.replace("\ufffd" + "x", "é")  # 6 then 8 completes a character


def test_text_streams_in_order():
    s = StreamText(CharTokenizer(), [])
    out = [s.add([1])[1], s.add([2, 3])[1], s.add([4])[1]]
    assert "".join(out) + s.flush() == "Hello world"


def test_incomplete_character_is_held_back():
    s = StreamText(CharTokenizer(), [])
    assert s.add([1, 6])[1] == "Hel"
    assert s.add([8])[1] == "é"


def test_stop_string_cuts_text_and_tokens():
    s = StreamText(CharTokenizer(), [" world"])
    ids, text = s.add([1, 2])
    assert text == "Hello" and ids == [1, 2]
    ids, text = s.add([3, 4, 5])
    assert s.stopped and ids == [3, 4] and text == ""
    assert s.flush() == ""


def test_possible_stop_prefix_is_held_until_it_is_not():
    s = StreamText(CharTokenizer(), ["lo!"])
    assert s.add([1, 2])[1] == "Hel"  # "lo" may begin "lo!"
    assert s.add([3])[1] == "lo wor"


def _stream(tokenizer, ids, stop=(), rounds=(1, 3, 2)):
    s = StreamText(tokenizer, list(stop))
    out, i, k = [], 0, 0
    while i < len(ids) and not s.stopped:
        n = rounds[k % len(rounds)]
        out.append(s.add(ids[i:i + n])[1])
        i, k = i + n, k + 1
    return "".join(out) + s.flush(), s


def test_the_real_tokenizer_streams_exactly_its_full_decode(target_dir):
    """Each token decodes a short window; the text streamed is the whole output's decode, character for
    character: words, code, accents, CJK and emoji split over byte-level tokens, and random token ids
    (bytes that never make a whole character included)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    texts = ["Hello , world . It's a test ! Ünïcödé 日本語 🙂 x\n\n  def f(x):\n\treturn x**2  # ½ ≤ ∞",
             "<|im_start|>assistant\nSure — here’s a list:\n1. 🍎 apple\n2. 🍌 banana<|im_end|>"]
    rng = random.Random(0)
    sequences = [tok(t)["input_ids"] for t in texts]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(300)] for _ in range(5)]
    for ids in sequences:
        for rounds in ((1,), (1, 3, 2), (7,)):
            text, s = _stream(tok, ids, rounds=rounds)
            assert text == tok.decode(ids, skip_special_tokens=True)
            assert s._prefix > 0 or len(ids) < 4  # the window moved on: not the whole output each time


def test_the_real_tokenizer_stops_where_the_full_decode_has_the_stop_string(target_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    ids = tok("One 🙂 two, three; four 日本 five. Six!")["input_ids"]
    full = tok.decode(ids)
    for stop in ("three", "日本", "🙂 t", "e. S"):
        text, s = _stream(tok, ids, stop=[stop])
        assert s.stopped and text == full[:full.index(stop)], stop
