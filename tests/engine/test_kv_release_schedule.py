"""engine.kv_release.ReleaseSchedule with a fake clock: when emptied sequences' streams are due back."""

from __future__ import annotations

from engine.kv_release import ReleaseSchedule


def test_a_release_is_due_after_the_delay_and_a_later_erase_moves_it_on() -> None:
    now = [100.0]
    sched = ReleaseSchedule(delay_s=5.0, clock=lambda: now[0])
    assert sched.due() == [] and sched.next_in() is None
    sched.schedule(3)
    now[0] = 102.0
    sched.schedule(1)
    assert sched.next_in() == 3.0 and sched.due() == []
    now[0] = 104.0
    sched.schedule(3)  # emptied again: due 5 s from now
    assert sched.next_in() == 3.0
    now[0] = 107.0
    assert sched.due() == [1] and sched.due() == [], "each due once"
    assert sched.next_in() == 2.0
    now[0] = 120.0
    assert sched.next_in() == 0.0 and sched.due() == [3] and sched.next_in() is None


def test_clear_forgets_every_pending_release() -> None:
    now = [0.0]
    sched = ReleaseSchedule(delay_s=1.0, clock=lambda: now[0])
    for seq in range(4):
        sched.schedule(seq)
    sched.clear()
    now[0] = 5.0
    assert sched.due() == [] and sched.next_in() is None
