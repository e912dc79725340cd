from ember.tokenization.detokenizer import StopStringMatcher


def feed(matcher, pieces):
    released, stop = [], None
    for piece in pieces:
        text, stop = matcher.push(piece)
        released.append(text)
        if stop:
            break
    return "".join(released), stop


def test_match_split_across_pieces_returns_text_before_it():
    text, stop = feed(StopStringMatcher(["STOP"]), ["Hello S", "T", "OP and more"])
    assert (text, stop) == ("Hello ", "STOP")


def test_earliest_of_several_stop_strings_wins():
    text, stop = feed(StopStringMatcher(["world", "lo w"]), ["hello world"])
    assert (text, stop) == ("hel", "lo w")


def test_include_in_output():
    text, stop = feed(StopStringMatcher(["\n\n"], include_in_output=True), ["a\n", "\nb"])
    assert (text, stop) == ("a\n\n", "\n\n")


def test_held_text_is_released_when_no_match_is_possible():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xxab") == ("xx", None)  # "ab" might start "abc"
    assert matcher.push("d") == ("a", None)  # the last two characters are always held
    assert matcher.flush() == "bd"


def test_no_stop_strings_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == ("anything", None)
    assert matcher.flush() == ""
