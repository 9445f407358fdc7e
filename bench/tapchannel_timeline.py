"""A 1F1B step with the TapChannel beside it, drawn from real timestamps of one run.

    .venv/bin/python -m bench.tapchannel_timeline          # PP=4 on CPU (gloo), 8 microbatches

Records, on every rank, the schedule's forward and backward of each (stage, microbatch), the last
stage's loss (policy + draft TTT), and the channel's puts (producers) and gets (draft stage),
for the step after a warm-up step; draws them to docs/tapchannel_timeline.png and writes the
events to --out. A line joins each put to the get that consumes it.
"""
import os
import time

import torch.distributed as dist

from bench._common import write_json
from bench.tapchannel_overhead import arg_parser, build, build_models, launch, random_batch
from titan_draft.infra.ranks import is_rank0


def timed(events, kind, stage, method):
    """Wrap a stage method whose first argument is the microbatch id, logging (kind, stage, id, t0, t1)."""
    def wrapper(chunk_id, *args, **kwargs):
        start = time.perf_counter()
        out = method(chunk_id, *args, **kwargs)
        events.append((kind, stage, chunk_id, start, time.perf_counter()))
        return out

    return wrapper


def record_step(run, tokens, labels):
    events = []
    for stage in run.stages:
        stage.forward_one_chunk = timed(events, "F", stage.stage_index, stage.forward_one_chunk)
        stage.backward_one_chunk = timed(events, "B", stage.stage_index, stage.backward_one_chunk)
    if run.has_last:
        loss_fn, count = run.schedule._loss_fn, [0]

        def timed_loss(output, target):
            start = time.perf_counter()
            out = loss_fn(output, target)
            events.append(("loss", len(run.stage_ranks) - 1, count[0], start, time.perf_counter()))
            count[0] += 1
            return out

        run.schedule._loss_fn = timed_loss
    run.channel.trace = events
    run.step(tokens, labels)
    return events


def draw(all_events, stage_ranks, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e[3] for events in all_events for e in events)
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    pp = len(all_events)
    fig, ax = plt.subplots(figsize=(14, 1.1 * pp + 1.2))
    colors = {"F": "#8ecae6", "B": "#f4a261", "loss": "#90be6d", "put": "#6a4c93", "get": "#d62828"}
    y_sched = {r: 2 * (pp - 1 - r) + 1 for r in range(pp)}  # schedule lane above the channel lane
    y_chan = {r: 2 * (pp - 1 - r) + 0.35 for r in range(pp)}
    puts, gets = {}, {}
    for rank, events in enumerate(all_events):
        for kind, stage, mb, start, end in events:
            if kind in ("F", "B", "loss"):
                y, h = y_sched[rank] - 0.4, 0.8 if kind != "loss" else 0.35
                ax.broken_barh([(ms(start), ms(end) - ms(start))], (y, h), color=colors[kind], edgecolor="k",
                               linewidth=0.3)
                if kind != "loss":
                    ax.text(ms(start) + (ms(end) - ms(start)) / 2, y_sched[rank], str(mb), ha="center",
                            va="center", fontsize=6)
            else:
                width = max(ms(end) - ms(start), 0.15)
                ax.broken_barh([(ms(start), width)], (y_chan[rank] - 0.25, 0.5), color=colors[kind])
                (puts if kind == "put" else gets)[(stage, mb)] = (ms(start), ms(end), rank)
    for key, (p_start, _, p_rank) in puts.items():
        if key in gets:
            g_start, g_end, g_rank = gets[key]
            ax.plot([p_start, g_end], [y_chan[p_rank], y_chan[g_rank]], color="#6a4c93", alpha=0.25, lw=0.7)
    ax.set_yticks([y_sched[r] for r in range(pp)] + [y_chan[r] for r in range(pp)])
    ax.set_yticklabels([f"rank {r}: stage {[s for s, x in enumerate(stage_ranks) if x == r]}" for r in range(pp)]
                       + [f"rank {r}: TapChannel" for r in range(pp)], fontsize=7)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["forward", "backward", "last stage loss (policy + draft TTT)", "tap put (isend)",
                        "tap get (wait + copy)"], fontsize=7, loc="upper right", ncol=5)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=150)


def main(args):
    policy, draft, spec = build_models(args)
    tokens, labels = random_batch(args, args.microbatch * args.microbatches)
    run = build(args, policy, draft, spec)
    run.step(tokens, labels)  # warm-up
    events = record_step(run, tokens, labels)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    if is_rank0():
        title = (f"{args.schedule}, PP={dist.get_world_size()}, {args.microbatches} microbatches of "
                 f"{args.microbatch} x {args.seq} tokens, dim {args.dim} x {args.layers} layers, taps "
                 f"{spec.tap_layers}, CPU gloo: one step after warm-up")
        draw(gathered, run.stage_ranks, args.png, title)
        write_json(args.out, dict(args=vars(args), events=gathered))
        step = max(e[4] for ev in gathered for e in ev) - min(e[3] for ev in gathered for e in ev)
        gets = [e[4] - e[3] for ev in gathered for e in ev if e[0] == "get"]
        puts = [e[4] - e[3] for ev in gathered for e in ev if e[0] == "put"]
        print(f"step {1e3 * step:.1f} ms; {len(puts)} puts, {1e3 * sum(puts):.2f} ms issuing; {len(gets)} gets, "
              f"{1e3 * sum(gets):.2f} ms waiting + copying; figure {args.png}")


if __name__ == "__main__":
    parser = arg_parser()
    parser.add_argument("--png", default="docs/tapchannel_timeline.png")
    parser.set_defaults(nproc=4, layers=8, microbatches=8, out="outputs/bench_tapchannel_timeline.json")
    launch(main, parser.parse_args())
