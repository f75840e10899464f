"""The thinking budget's state machine (engine/reasoning_budget.py), on a vocabulary of a few pieces:
counting from the start tag, the forced message and end tag, a natural end, a fresh budget for a second
thought, a character left unfinished when the budget runs out, and tags spelled over several tokens."""

from __future__ import annotations

from engine.reasoning_budget import BudgetState, ReasoningBudget, utf8_complete

PIECES = [b"<think>", b"a", b"</think>", b"Stop.", b"\xc3", b"\xa9", b"<", b"think>", b"</", b"think>", b" "]
START, A, END, MSG, HALF1, HALF2, LT, THINK_GT, CLOSE_LT, _, SPACE = range(len(PIECES))


def run(budget: ReasoningBudget, tokens: list[int]) -> list[int | None]:
    """Accept ``tokens`` one by one (each replaced by the forced token when there is one): what was forced."""
    forced: list[int | None] = []
    for tok in tokens:
        f = budget.forced()
        forced.append(f)
        budget.accept(tok if f is None else f)
    return forced


def make(budget: int, opened: bool = False) -> ReasoningBudget:
    return ReasoningBudget(b"<think>", b"</think>", [MSG, END], budget, opened, PIECES)


def test_budget_forces_the_message_then_the_end_tag() -> None:
    b = make(2)
    assert run(b, [A, START, A]) == [None, None, None] and b.state is BudgetState.COUNTING
    assert run(b, [A]) == [None] and b.state is BudgetState.FORCING  # the second token of the thought spent it
    assert run(b, [A, A, A]) == [MSG, END, None] and b.state is BudgetState.DONE


def test_a_natural_end_and_a_second_thought() -> None:
    b = make(3)
    assert run(b, [START, A, END]) == [None, None, None] and b.state is BudgetState.DONE
    assert run(b, [A, START, A, A, A, A, A]) == [None, None, None, None, None, MSG, END]  # a fresh budget


def test_an_opened_prompt_counts_from_the_first_token_and_zero_ends_at_once() -> None:
    b = make(1, opened=True)
    assert run(b, [A, A, A, A]) == [None, MSG, END, None]
    zero = make(0, opened=True)
    assert run(zero, [A, A, A]) == [MSG, END, None]
    assert run(make(0), [START, A, A, A]) == [None, MSG, END, None]


def test_an_unfinished_character_is_completed_before_the_end_is_forced() -> None:
    b = make(1, opened=True)
    assert run(b, [HALF1]) == [None] and b.state is BudgetState.WAITING_UTF8
    assert run(b, [HALF2, A, A]) == [None, MSG, END]
    assert utf8_complete(b"a\xc3\xa9") and not utf8_complete(b"a\xc3") and utf8_complete(b"")


def test_tags_spelled_over_several_tokens() -> None:
    b = make(5)
    assert run(b, [LT, THINK_GT]) == [None, None] and b.state is BudgetState.COUNTING
    assert run(b, [A, CLOSE_LT, THINK_GT]) == [None, None, None] and b.state is BudgetState.DONE
    assert run(make(5), [LT, SPACE, THINK_GT, A])[-1] is None  # "< think>" opens nothing
