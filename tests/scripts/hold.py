"""Hold a test run at a point it reports, so a test signals it there whatever the machine's speed.

    hold = Hold("step:60", go=None, announce=lambda point: print(point))
    hold.at("step", 59)  # not the point: returns at once
    hold.at("step", 60)  # announces "step:60", then waits for the go file (here: to be killed)
"""

import os
import time
from collections.abc import Callable


class Hold:
    """Holds the run once at ``PHASE:STEP`` until the file ``go`` exists (no hold without a spec).

    On arrival it calls ``announce("PHASE:STEP")``; with ``go`` None the run waits there to be killed.
    """

    def __init__(self, spec: str | None, go: str | None, announce: Callable[[str], None]) -> None:
        phase, _, step = (spec or ":").partition(":")
        self.phase, self.step, self.go, self.announce = phase, int(step or -1), go, announce

    def due(self, phase: str, step: int | None) -> bool:
        return phase == self.phase and step == self.step

    def at(self, phase: str, step: int | None) -> None:
        if not self.due(phase, step):
            return
        self.phase = None  # once
        self.announce(f"{phase}:{step}")
        while self.go is None or not os.path.exists(self.go):
            time.sleep(0.005)
