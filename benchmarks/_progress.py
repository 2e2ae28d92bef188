"""Progress lines for long benchmark runs: what runs now, the time since the start and, once a
step has finished, an estimate of the time left.

    progress = Progress(total=8)
    progress.start("fp32 N=4096 V=32768 D=512: flce")
    ...                                   # the measurement
    progress.done("1.62 s, 246 MB")

prints, on stdout and flushed at once (a run cut by a timeout keeps what it printed):

    [1/8 0:00:00] fp32 N=4096 V=32768 D=512: flce ...
    [1/8 0:00:14] fp32 N=4096 V=32768 D=512: flce: 1.62 s, 246 MB (ETA 0:01:38)

The estimate assumes the steps left take as long as the finished ones did on average: right for
repeats of one configuration, rough across shapes.
"""
import sys
import time


def hms(seconds):
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total, out=None, clock=time.monotonic):
        self.total, self.done_steps = max(int(total), 1), 0
        self.out = out or sys.stdout
        self.clock = clock
        self.t0 = clock()
        self.what = ""

    def _head(self):
        k = min(self.done_steps + 1, self.total)
        return f"[{k}/{self.total} {hms(self.clock() - self.t0)}]"

    def _print(self, line):
        print(line, file=self.out, flush=True)

    def start(self, what):
        """A step begins: name it."""
        self.what = what
        self._print(f"{self._head()} {what} ...")

    def done(self, result="done"):
        """The step begun last has finished with ``result`` (a short summary)."""
        head = self._head()
        self.done_steps += 1
        elapsed = self.clock() - self.t0
        left = self.total - self.done_steps
        eta = f" (ETA {hms(elapsed / self.done_steps * left)})" if left > 0 else ""
        self._print(f"{head} {self.what}: {result}{eta}")
