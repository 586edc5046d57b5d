"""Where should the NaN guard read the gradients: in backward, or in the step?

``python -m ampfused.benchmarks.grad_stats_placement``: the sum of squares and the non-finite flag
must be known before the update writes anything (DESIGN §2.2). On fp32 params they cost one read
of every gradient (4 B/param). This times the two places that read can live, interleaved, on the
same GPT-2-like 4M-param shapes at 1 and 2 threads:

- **hook**: a post-accumulate-grad hook per param computes that param's stats right after autograd
  wrote its gradient (while it may still be in cache) -- timed as backward with the hooks minus
  backward without them, since moving work into backward is not removing it;
- **pass**: the stats pass over all gradients in ``step()`` (what ampfused does) -- one op, split
  over the threads.

The backward is a stand-in with one fresh gradient per param (``loss = sum((p * x).sum())``), so
its own cost is the same in both columns. Before any number is printed, the hooks' stats are
checked against the pass's.
"""
from __future__ import annotations

import statistics
import time

import torch

from ampfused import _compiled

from .configs import shape_set


class Model:
    """Params of the given sizes and a backward that gives each a fresh gradient."""

    def __init__(self, sizes: list[int], hook: str | None):
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        self.inputs = [torch.randn(n, generator=gen) for n in sizes]
        self.slots = torch.zeros(len(sizes), 4)  # one stats vector per param (the hooks')
        ops, nothing = torch.ops.ampfused, [torch.empty(0)]
        for p, slot in zip(self.params, self.slots):
            if hook == "stats":
                p.register_post_accumulate_grad_hook(lambda p, s=slot: ops.grad_stats([p.grad], None, None, None, s))
            elif hook == "dispatch only":
                p.register_post_accumulate_grad_hook(lambda p, s=slot: ops.grad_stats(nothing, None, None, None, s))

    def backward(self) -> None:
        for p in self.params:
            p.grad = None
        sum((p * x).sum() for p, x in zip(self.params, self.inputs)).backward()


def main(total: int = 4_000_000, rounds: int = 30) -> None:
    module, why = _compiled.load()
    if module is None:
        raise SystemExit(f"the compiled cpu backend is needed here: {why}")
    sizes = list(shape_set("gpt2-like", total).sizes)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        models = {kind: Model(sizes, kind) for kind in (None, "dispatch only", "stats")}
        stats = torch.empty(4)
        grads = lambda: [p.grad for p in models[None].params]  # noqa: E731
        work = {f"backward, hook: {k}" if k else "backward": m.backward for k, m in models.items()}
        work["stats pass (in step)"] = lambda: torch.ops.ampfused.grad_stats(grads(), None, None, None, stats)
        times = {name: [] for name in work}
        for _ in range(rounds + 1):  # the first round allocates and is not timed
            for name, fn in work.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        hooked = models["stats"].slots
        torch.testing.assert_close(hooked[:, 3].double().sum(), stats[3].double(), rtol=1e-5, atol=0)
        assert bool(hooked[:, 1].any()) == bool(stats[1]), "hooks and pass disagree on the non-finite flag"
        m = {name: statistics.median(v[1:]) * 1e3 for name, v in times.items()}
        base = m["backward"]
        print(f"{threads} thread(s): backward {base:.2f} ms; the stats cost "
              f"{m['backward, hook: stats'] - base:+.2f} ms in per-param hooks "
              f"({m['backward, hook: dispatch only'] - base:+.2f} ms of it dispatch), "
              f"{m['stats pass (in step)']:.2f} ms as the pass in step()")


if __name__ == "__main__":
    main()
