"""Action and reflection extraction (spec section 3)."""

from mage_jax.envs.parsing import MAX_REFLECTION_CHARS, extract_action, extract_reflection


def test_action_is_the_first_complete_tag_pair_stripped():
    assert extract_action("<think>hmm</think> <action> BET </action>") == "BET"
    assert extract_action("<action>PASS</action><action>BET</action>") == "PASS"


def test_missing_or_unclosed_action_is_none():
    assert extract_action("I bet") is None
    assert extract_action("<action>BET") is None
    assert extract_action("</action>BET<action>") is None


def test_reflection_is_capped_and_missing_tags_are_invalid():
    text, valid = extract_reflection("<remark>" + "x" * 5000 + "</remark>")
    assert valid and len(text) == MAX_REFLECTION_CHARS
    assert extract_reflection("no tags") == ("", False)
