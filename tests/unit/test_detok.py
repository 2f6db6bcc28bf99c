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
