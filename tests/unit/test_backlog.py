"""A stream's unread tokens and when its request is paused and resumed (engine.backlog)."""

from ember.engine.backlog import Backlog


def test_a_backlog_pauses_past_its_bound_once_and_resumes_below_half():
    backlog = Backlog(limit=8)
    assert [backlog.delivered(1) for _ in range(8)] == [False] * 8  # at the bound: not yet
    assert backlog.delivered(1) is True and backlog.paused
    assert backlog.delivered(3) is False  # already paused: said once
    assert [backlog.taken(1) for _ in range(7)] == [False] * 7  # 12 unread down to 5: not below 4
    assert backlog.taken(1) is False and backlog.unread == 4
    assert backlog.taken(1) is True and not backlog.paused and backlog.unread == 3
    assert backlog.taken(1) is False  # already resumed


def test_a_reader_that_keeps_up_is_never_paused():
    backlog = Backlog(limit=4)
    for _ in range(100):
        assert backlog.delivered(3) is False
        assert backlog.taken(3) is False
    assert backlog.unread == 0


def test_after_the_engine_forgets_a_pause_the_next_delivery_past_the_bound_pauses_again():
    backlog = Backlog(limit=4)
    backlog.delivered(5)
    backlog.engine_forgot()
    assert not backlog.paused
    assert backlog.delivered(1) is True
