"""``python benchmarks/step_host_cost.py N_TENSORS NUMEL CASE``: the host cost of one FusedAmpAdamW.step()
on the cpu backend over tiny fp32 tensors, as process CPU time (not wall time: it holds on a shared
machine) and as the number of Python and C calls the step makes (independent of load).

CASE: plain (a GradScaler's scale, no clip), clip (max_grad_norm too), fresh (clip, and new grad
tensors every step), wide (clip, plus four float64 params: the reference passes' share).
Results: docs/results/batch-host.md."""
import statistics, sys, time
import torch
import ampfused
torch.set_num_threads(1)
n_tensors, numel, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n_tensors)]
if case == "wide":
    params += [torch.nn.Parameter(torch.randn(numel, dtype=torch.float64)) for _ in range(4)]
kw = dict(max_grad_norm=1.0) if case in ("clip", "wide", "fresh") else {}
opt = ampfused.FusedAmpAdamW(params, lr=1e-3, backend="cpu", **kw)
scale = torch.tensor(1024.0)
def grads():
    for p in params:
        p.grad = torch.randn_like(p)
grads()
def step():
    if case == "fresh":
        grads()
    opt.grad_scale = scale
    opt.step()
for _ in range(20):
    step()
calls = [0]
def prof(frame, event, arg):
    if event in ("call", "c_call"):
        calls[0] += 1
sys.setprofile(prof); step(); sys.setprofile(None)
times = []
for _ in range(15):
    t = time.process_time()
    for _ in range(20):
        step()
    times.append((time.process_time() - t) / 20 * 1e3)
print(f"{ampfused.__file__.rsplit('/', 3)[-3]:10s} {case:5s} {n_tensors}x{numel}: cpu {statistics.median(times):.3f} ms/step (min {min(times):.3f}), {calls[0]} python+C calls/step")
