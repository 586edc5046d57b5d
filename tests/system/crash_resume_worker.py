"""A small training run for tests/system/test_crash_resume.py, run as a subprocess.

usage: crash_resume_worker.py DIR STEPS [--resume] [--slow-after N] [--die-in-save K]

Trains two tiny MLPs side by side, one with fp32 params under bf16 autocast and one with bf16 params
(fp32 master weights and accumulation), each with dropout, 2 micro-batches, an overflow every 7th
step, max_grad_norm, OneCycleLR and ampfused.GradScaler, and writes DIR/ckpt/stepNNNN.pt every 3 steps through
ampfused.checkpoint; prints "step N" after each step. --resume continues from the newest valid
checkpoint. --die-in-save K SIGKILLs the process inside the K-th save, after the data is written
and before the file is renamed into place. At the end writes DIR/final.pt.
"""
import argparse
import math
import os
import signal
import sys
import time

import torch

import ampfused
import ampfused.checkpoint as ckpt

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("steps", type=int)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--slow-after", type=int, default=None)
parser.add_argument("--die-in-save", type=int, default=None)
args = parser.parse_args()

torch.manual_seed(0)
DTYPES = (torch.float32, torch.bfloat16)  # fp32 params under autocast; bf16 params with master weights + fp32 accumulation
runs = {}
for dtype in DTYPES:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)).to(dtype)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, weight_decay=0.05, max_grad_norm=1.0)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0**8, growth_interval=4, hysteresis=2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=args.steps + 1)
    runs[str(dtype)] = dict(model=model, optimizer=opt, scaler=scaler, scheduler=sched)
ckpt_dir = os.path.join(args.dir, "ckpt")
os.makedirs(ckpt_dir, exist_ok=True)


def state_of(extra):
    state = {f"{name}/{key}": obj.state_dict() for name, run in runs.items() for key, obj in run.items()}
    return {**state, **extra}


start, losses = 0, []
if args.resume:
    path = ckpt.latest(ckpt_dir)
    state = ckpt.load(path)
    for name, run in runs.items():
        for key, obj in run.items():
            obj.load_state_dict(state[f"{name}/{key}"])
    ckpt.set_rng_state(state["rng"])
    start, losses = state["step"], state["losses"]
    print(f"resumed {os.path.basename(path)}", flush=True)

saves = 0
if args.die_in_save is not None:
    real_fsync = os.fsync

    def fsync(fd):
        if saves + 1 == args.die_in_save and not os.path.isdir(f"/proc/self/fd/{fd}"):
            os.kill(os.getpid(), signal.SIGKILL)  # the tmp file is written, not yet renamed
        real_fsync(fd)
    os.fsync = fsync

for step in range(start, args.steps):
    total = 0.0
    for dtype in DTYPES:
        model, opt, scaler, sched = runs[str(dtype)].values()
        for micro in range(2):
            x, y = torch.randn(6, 8), torch.randn(6, 4)  # the data stream comes from the saved RNG too
            if dtype == torch.float32:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
            else:
                out = model(x.to(dtype))
            loss = torch.nn.functional.mse_loss(out.float(), y) / 2
            if step % 7 == 3 and micro == 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    losses.append(total)
    if (step + 1) % 3 == 0:
        ckpt.save(state_of({"rng": ckpt.rng_state(), "step": step + 1, "losses": losses}),
                  os.path.join(ckpt_dir, f"step{step + 1:04d}.pt"))
        saves += 1
    print(f"step {step + 1}", flush=True)
    if args.slow_after is not None and step + 1 >= args.slow_after:
        time.sleep(0.5)  # leave the parent time to kill us mid-run

torch.save(state_of({"losses": losses}), os.path.join(args.dir, "final.pt"))
sys.exit(0)
