"""Action and reflection extraction (docs/method.md §3; the rule is in ``mage_jax.envs.parsing``)."""

from mage_jax.envs.parsing import extract_action, extract_reflection, strip_thinking


def test_action_is_the_last_complete_tag_pair_stripped():
    assert extract_action("<action> BET </action>") == "BET"
    assert extract_action("<action>PASS</action><action>BET</action>") == "BET"
    assert extract_action("<action>PASS</action> or rather <action>BET") == "PASS"


def test_tags_mentioned_while_thinking_do_not_count():
    thinking = (
        "<think>I hold a Jack. Maybe <action>BET</action> as a bluff? No: against this opponent "
        "<action>BET</action> loses. I will pass.</think>\nI pass. <action>PASS</action>"
    )
    assert extract_action(thinking) == "PASS"
    assert extract_action("<think>answer with <action>(1, 1)</action></think>no tags after") is None


def test_thinking_opened_by_the_chat_template_ends_at_its_closing_tag():
    """Some chat templates put ``<think>`` in the prompt: the response starts inside the reasoning."""
    response = "the centre, <action>(2, 2)</action>, is taken...</think>\n\n<action>(1, 3)</action>"
    assert extract_action(response) == "(1, 3)"
    assert strip_thinking("a <think>b</think> c </think> d") == " d"


def test_a_response_cut_inside_its_reasoning_keeps_the_text():
    assert extract_action("<think>so <action>BET</action> it is") == "BET"


def test_missing_or_unclosed_action_is_none():
    assert extract_action("I bet") is None
    assert extract_action("<action>BET") is None
    assert extract_action("</action>BET<action>") is None


def test_reflection_follows_the_same_rule():
    response = "<think>draft: <remark>bet</remark></think><remark>fold the Jack</remark>"
    assert extract_reflection(response) == ("fold the Jack", True)
    assert extract_reflection("<remark>a</remark> <remark>b</remark>") == ("b", True)


def test_reflection_is_capped_at_2000_characters_and_missing_tags_are_invalid():
    text, valid = extract_reflection("<remark>" + "x" * 5000 + "</remark>")
    assert valid and text == "x" * 2000
    exact = "y" * 1999 + "z"
    assert extract_reflection(f"<remark>{exact}</remark>") == (exact, True)
    assert extract_reflection("<remark>" + "w" * 2001 + "</remark>")[0] == "w" * 2000
    assert extract_reflection("no tags") == ("", False)


def test_a_stray_closing_tag_never_ends_up_inside_the_answer():
    assert extract_action("<action></action></action>") == ""
    assert extract_action("<action>BET</action> and </action>") == "BET"
