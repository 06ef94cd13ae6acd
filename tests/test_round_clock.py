"""``RoundClock`` and ``StageTimer`` (taps.decode.timing) against a clock the test drives: exact seconds on the
host path, and on the CUDA path events recorded at the boundaries and resolved only when asked (stand-in
events, so this runs without a GPU)."""
import pytest
import torch

from taps.decode import timing
from taps.decode.timing import RoundClock, StageTimer


class FakeClock:
    """``perf_counter`` that returns the times it is given, in order."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


class FakeEvent:
    """A CUDA event stand-in: ``record`` stamps the next time of ``clock``; ``elapsed_time`` in milliseconds."""

    log = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = FakeEvent.clock()
        FakeEvent.log.append(("record", self.t))

    def elapsed_time(self, end):
        FakeEvent.log.append(("elapsed", self.t, end.t))
        return (end.t - self.t) * 1000.0


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.log = []
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    return syncs


def test_round_clock_on_the_host_is_the_perf_counter_difference(monkeypatch):
    monkeypatch.setattr(timing.time, "perf_counter", FakeClock(10.0, 10.375, 20.0, 20.5))
    clock = RoundClock(torch.device("cpu"))
    assert not clock.cuda
    clock.start()
    handle = clock.stop()
    assert RoundClock.seconds(handle) == 0.375
    clock.start()  # a second round starts from its own start
    assert RoundClock.seconds(clock.stop()) == 0.5
    assert not RoundClock(None).cuda


def test_round_clock_on_cuda_records_events_and_resolves_late(fake_cuda):
    FakeEvent.clock = FakeClock(1.0, 1.25)
    clock = RoundClock(torch.device("cuda"))
    assert clock.cuda
    clock.start()
    handle = clock.stop()
    assert FakeEvent.log == [("record", 1.0), ("record", 1.25)]  # nothing resolved yet: no synchronisation
    assert fake_cuda == []
    assert RoundClock.seconds(handle) == 0.25
    assert FakeEvent.log[-1] == ("elapsed", 1.0, 1.25)


def test_stage_timer_on_the_host_sums_repeated_and_nested_stages(monkeypatch):
    monkeypatch.setattr(timing.time, "perf_counter", FakeClock(0.0, 1.0, 1.5, 3.5, 4.0, 4.25))
    t = StageTimer(torch.device("cpu"))
    with t("pool"):                 # 0.0 .. 4.25, two nested stages inside
        with t("score"):            # 1.0 .. 1.5
            pass
        with t("score"):            # 3.5 .. 4.0: the same name adds up
            pass
    assert t.seconds() == {"score": 1.0, "pool": 4.25}


def test_stage_timer_on_cuda_resolves_events_once(fake_cuda):
    FakeEvent.clock = FakeClock(0.0, 0.5, 1.0, 1.75)
    t = StageTimer(torch.device("cuda"))
    with t("draft"):
        pass
    with t("draft"):
        pass
    assert fake_cuda == []  # no synchronisation without profile
    assert t.seconds() == {"draft": 0.5 + 0.75}
    assert t.seconds() == {"draft": 1.25}  # resolved once: asking again adds nothing


def test_stage_timer_profile_synchronises_at_every_boundary(fake_cuda):
    FakeEvent.clock = FakeClock(0.0, 2.0)
    dev = torch.device("cuda")
    t = StageTimer(dev, profile=True)
    with t("verify"):
        pass
    assert fake_cuda == [dev, dev]
    assert t.seconds() == {"verify": 2.0}
