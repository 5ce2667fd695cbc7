"""Where a step's time goes: wall and CPU time per label, for the benchmarks."""
from __future__ import annotations

import time
from collections import defaultdict


class Clock:
    """Accumulates wall and CPU time per label; nested labels are subtracted from the outer."""

    def __init__(self):
        self.wall = defaultdict(float)
        self.cpu = defaultdict(float)
        self.stack: list[list] = []

    def wrap(self, label, fn):
        def timed(*a, **k):
            w0, c0 = time.perf_counter(), time.process_time()
            self.stack.append([0.0, 0.0])
            try:
                return fn(*a, **k)
            finally:
                inner_w, inner_c = self.stack.pop()
                dw, dc = time.perf_counter() - w0, time.process_time() - c0
                self.wall[label] += dw - inner_w
                self.cpu[label] += dc - inner_c
                if self.stack:
                    self.stack[-1][0] += dw
                    self.stack[-1][1] += dc
        return timed

    def reset(self):
        self.wall.clear()
        self.cpu.clear()
