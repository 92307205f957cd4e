"""``pp=P`` per stage, as ``apply`` realises it (``apply/pipeline_parallel.py``).

The repeated blocks (``plan.repeated_blocks``) are cut into P contiguous stages
(``stage_ranges``, the same split apply makes).  Per stage s, on the one micro-step
timeline after the batch split (micro-batch B / M):

* model state: the gradients of other stages' blocks are dropped (gradient rows carry their
  parameter's module); parameter and optimizer-state rows carry no module, so they are
  scaled by the share of the parameter bytes this rank holds: its blocks plus the layers
  outside the stack, which apply keeps on every rank (their gradients are summed over the
  stages, so each rank holds them and their optimizer state too);
* activations and temporaries: those made inside this stage's blocks; those made outside
  the stack before the blocks (embeddings) on the first stage only, after them (final norm,
  head, loss) on the last stage only;
* in-flight micro-batches: the saved activations of this stage (alive where forward turns
  into backward) held for ``in_flight`` micro-batches -- GPipe: M on every stage; 1F1B:
  min(M, P - s), so stage 0 holds the most.  The peak is the larger of the first backward
  (one micro-step's peak, no gradients of this stage yet, in_flight - 1 others stashed)
  and a later one (M micro-steps' accumulated peak, gradients present, with in_flight - 1
  others stashed in 1F1B's steady state when M > in_flight, else in_flight - 2);
* what the script holds of the model's output: under a pipeline the model call returns
  the step's mean loss and nothing else, and a loss the script computes from the output
  (``logits = model(x); loss = f(logits, y)``) runs in the last stage's loss function
  (apply/loss_expression.py), whose locals die when it returns.  So forward temporaries
  outside the stack that the unmodified script kept past the forward (its ``logits``
  variable: not saved by autograd, alive into the backward) live only until the backward
  starts, and those it kept from the previous step (alive when the step begins) are gone;
  what autograd saves for the loss's backward (log-softmax's output) stays an activation,
  held per in-flight micro-batch like the blocks' own;
* a weight tied between the embedding and the head (GPT): its gradient is held by both end
  stages (the trace has one, made after the blocks' backward; the head's forward read the
  parameter: the trace's data flow says so);
* P2P buffers (torch 2.13's ``PipelineStage`` makes one receive buffer per micro-batch and
  keeps them across steps): a stage after the first holds M buffers of the stream it
  receives, plus (1f1b, gpipe) the input gradient it sent back last; a stage before the
  last holds M buffers for the output gradients it receives;
* the gradient of a stage's output, from which a stage before the last runs its backward:
  the unmodified trace has it among the next block's rows, so no stage's rows hold it.

Under ``shard=zero2|zero3`` (D replicas of the pipeline) the model state above is the
stage's 1/D shard, and FSDP's gathered parameters and buffers are the stage's own: its
blocks and the root, per micro-batch (``pipeline_sharding.py``).  zero2 keeps a block
gathered from its forward to its post-backward, which runs after each micro-batch's
backward; with several micro-batches in flight on a stage (1f1b's stages before the last:
F0 F1 B0 B1) FSDP's backward prefetch, ordered by every forward's record, gathers each
block that post-backward just resharded again for the next micro-batch's backward: those
backwards gather and free as zero3's do, and run zero3's micro-step (measured: gpt_lm 4
layers, pp=2 stage 0, zero2's peak equals zero3's to the byte, at a prefetch's all-gather
in the first backward).

Under ``schedule=interleaved`` the stack is cut into P x V stages and rank r holds stages
r, r + P, ... (torch's placement); each stage's rows are taken as above, and the rank's
peak is found at every backward of torch's order (``pipeline_schedule.py``): that stage's
micro-step (its first: no gradients of it yet; a later one: accumulated) beside the saved
activations of every micro-batch in flight on each of the rank's stages, the gradients of
its stages whose backward already ran, and the sends torch's runtime for several stages
per rank keeps until the step ends (each stream sent forward and each input gradient sent
back, past its micro-batch's backward).  The in-flight counts come from the schedule torch
runs, not from a formula (rank 0 of pp=2 x 2 stages, M=4: 3 on stage 0 and 2 on stage 2 at
its peak).

Step time: the share of the pipelined step every rank idles, from running torch's order
with each action's dependencies (1f1b, gpipe: (P - 1) / (M + P - 1); interleaved:
(P - 1) / (V M + P - 1) for M in full rounds).

Pure numpy over the timeline (no torch).
"""
from __future__ import annotations

import numpy as np

from ..plan import Plan, PlanError, pipeline_stage_ranges
from ..trace import schema
from . import pipeline_schedule, pipeline_sharding
from .accumulation import accumulated_peak, first_and_accumulated_peaks
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_FORWARD, _BACKWARD = PHASE_CODE[schema.FORWARD], PHASE_CODE[schema.BACKWARD]
_GRADIENT, _PARAMETER = CATEGORY_CODE[schema.GRADIENT], CATEGORY_CODE[schema.PARAMETER]
_STATE = CATEGORY_CODE[schema.OPTIMIZER_STATE]
_ACTIVATION = CATEGORY_CODE[schema.ACTIVATION]
_TEMPORARY = CATEGORY_CODE[schema.TEMPORARY]
_OTHER = CATEGORY_CODE[schema.OTHER]


stage_ranges = pipeline_stage_ranges  #: the rule lives with the plan (plan.py)


def in_flight_micro_batches(plan: Plan, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` (one per rank: 1f1b, gpipe) holds
    at once under the schedule, from the order torch runs it (pipeline_schedule.py)."""
    actions = pipeline_schedule.rank_actions(plan.schedule, plan.pp, 1,
                                             plan.pipeline_microbatches, stage)
    return max(held[0] for _, held, _ in
               pipeline_schedule.in_flight_at_backwards(actions, 1))


def bubble_fraction(plan: Plan) -> float:
    """Share of the pipelined step every rank idles under torch's schedule (1f1b and gpipe:
    (P - 1) / (M + P - 1); interleaved: (P - 1) / (V M + P - 1) where M divides into full
    rounds)."""
    if plan.pp <= 1:
        return 0.0
    return pipeline_schedule.bubble_fraction(plan.schedule, plan.pp,
                                             plan.pipeline_stages_per_rank,
                                             plan.pipeline_microbatches)


def _block_of_rows(timeline: Timeline, blocks: list[str]) -> np.ndarray:
    """Per row: the index of the block its module is in, -1 outside the stack."""
    per_module = np.full(len(timeline.modules), -1, dtype=np.int64)
    for code, path in enumerate(timeline.modules):
        for index, block in enumerate(blocks):
            if path == block or path.startswith(block + "."):
                per_module[code] = index
                break
    return per_module[timeline.module] if len(timeline) else np.zeros(0, np.int64)


def stage_peaks(timeline: Timeline, plan: Plan, blocks: list[str],
                block_parameter_fraction: dict[str, float]) -> dict:
    """Per stage: peak bytes and the terms it is made of; the worst stage first in
    ``worst_stage``."""
    if not blocks:
        raise PlanError(f"pp={plan.pp} found no repeated blocks (a ModuleList or Sequential "
                        "of same-class modules) in the trace's module tree to cut into stages")
    timeline = _without_ddp_bucket(timeline, plan)
    fsdp = plan.shard in ("zero2", "zero3") and plan.shard_group_size > 1
    if fsdp:  # made again per stage below (pipeline_sharding.py)
        timeline, copies = pipeline_sharding.without_sharding_rows(timeline)
    ranges = stage_ranges(len(blocks), plan.pipeline_stages)
    block = _block_of_rows(timeline, blocks)
    outside = block < 0
    forward = timeline.phase == _FORWARD
    backward = timeline.phase == _BACKWARD
    in_blocks_forward = forward & ~outside
    first_block_key = (timeline.alloc_key[in_blocks_forward].min()
                       if in_blocks_forward.any() else 0.0)
    in_blocks_backward = backward & ~outside
    last_backward_key = (timeline.alloc_key[in_blocks_backward].max()
                         if in_blocks_backward.any() else np.inf)
    # outside the stack: made before the blocks' forward or after their backward (embedding
    # and its gradient) -> first stage; between (final norm, head, loss, their backward)
    # -> last stage.  Rows of other phases (optimizer, before the step) stay everywhere.
    # (what the process keeps from before the step to its end outside any module -- cuBLAS's
    # workspaces on a CUDA target -- every stage's process has: it stays everywhere too)
    activity = (forward | backward) & ~((timeline.category == _OTHER) & outside
                                        & (timeline.alloc_key < 0)
                                        & (timeline.free_key >= timeline.n_events))
    pre = outside & activity & ((timeline.alloc_key < first_block_key)
                                | (timeline.alloc_key > last_backward_key))
    post = outside & activity & ~pre
    # the step's first backward event (not the earliest backward-phase row: the previous
    # step's gradients are alive from before the step, key -1)
    backward_events = np.flatnonzero(timeline.event_phase == _BACKWARD)
    backward_start = (float(backward_events[0]) if len(backward_events)
                      else float(timeline.n_events))
    timeline, held_output_bytes = _without_script_held_output(
        timeline, outside & forward, first_block_key, backward_start)
    tied, made_key = _tied_gradients(timeline, outside, pre, post & forward, backward)
    # on the last stage a tied weight's gradient is made by the head's backward (the trace
    # has it once, made after the embedding's)
    last_timeline = timeline.retimed(
        np.where(tied & (timeline.alloc_key >= 0), made_key, timeline.alloc_key),
        timeline.free_key) if tied.any() else timeline
    block_share = [float(block_parameter_fraction.get(b, 0.0)) for b in blocks]
    outside_share = max(1.0 - sum(block_share), 0.0)
    stream_bytes = _stream_bytes(timeline, block)

    state_rows = (timeline.category == _PARAMETER) | (timeline.category == _STATE)
    made_in_step = timeline.alloc_key >= 0
    num_stages = plan.pipeline_stages
    virtual = plan.pipeline_stages_per_rank
    micro_batches = plan.pipeline_microbatches

    def stage_terms(stage: int, held: float, collectives_held: bool = False,
                    first: bool = False, shard: str = plan.shard) -> dict:
        """One stage's rows on the rank's timeline: its one micro-step, M accumulated, its
        saved activations and the gradients it makes (per micro-batch).
        ``collectives_held``: FSDP's buffers held by gloo's worker until the next
        collective (pipeline_sharding.py)."""
        owned = ranges[stage]
        mine = np.isin(block, list(owned))
        keep = mine | (outside & ~pre & ~post)
        if stage == 0:
            keep |= pre
        if stage == num_stages - 1:
            keep |= post | tied
        keep |= state_rows  # scaled below: no module on these rows
        keep &= ~((timeline.category == _GRADIENT) & ~outside & ~mine)
        sizes = np.where(keep, timeline.size, 0.0)
        sizes = np.where(state_rows, timeline.size * held, sizes)
        local = (last_timeline if stage == num_stages - 1 else timeline).resized(sizes)
        if fsdp:
            local = local.appended(pipeline_sharding.stage_rows(
                timeline, shard, plan.shard_group_size, blocks, list(owned),
                block_parameter_fraction, {**copies, "held_until_next": collectives_held},
                stage == num_stages - 1))
        own_gradients = (timeline.category == _GRADIENT) & made_in_step & (
            mine | (pre if stage == 0 else False) | (tied if stage == num_stages - 1
                                                     else False))
        one, accumulated = first_and_accumulated_peaks(local, micro_batches, categories=False,
                                                       first_categories=first)
        return {"one": one, "accumulated": accumulated,
                "saved": float(sizes[forward & (timeline.free_key > backward_start)
                                     & (timeline.category == _ACTIVATION)].sum()),
                "gradients": float(sizes[own_gradients].sum())}

    stages = []
    for rank in range(plan.pp):
        mine_stages = list(range(rank, num_stages, plan.pp))  # torch's loop placement
        held = outside_share + sum(block_share[i] for g in mine_stages for i in ranges[g])
        # the rank's first stage's one micro-step is what the output breaks down by category
        terms = [stage_terms(g, held, first=(g == mine_stages[0])) for g in mine_stages]
        actions = pipeline_schedule.rank_actions(plan.schedule, plan.pp, virtual,
                                                 micro_batches, rank)
        # torch's runtime for several stages per rank (_PipelineScheduleRuntime) waits on
        # its sends only when the step ends, so each stream a stage sent forward and each
        # input gradient it sent back stays alive until then, past the micro-batch's
        # backward (Schedule1F1B / ScheduleGPipe wait on them as they go)
        sends_per_backward = [(g < num_stages - 1) + (g > 0) if virtual > 1 else 0
                              for g in mine_stages]
        # a stage before the last runs its backward from the gradient of its output, which
        # the unmodified trace has among the next block's rows (no stage's here)
        output_gradient = [stream_bytes if g < num_stages - 1 else 0.0 for g in mine_stages]
        # zero2: the backwards that gather the blocks again run zero3's micro-step
        regather = ([stage_terms(g, held, shard="zero3") for g in mine_stages]
                    if fsdp and plan.shard == "zero2" else None)
        peak, at_peak = _peak_over_backwards(terms, actions, virtual, sends_per_backward,
                                             stream_bytes, output_gradient, regather)
        # a backend whose worker may hold FSDP's buffers to the next collective (a race:
        # runs land on either figure, rank by rank) gets the late figure beside; apply
        # drains gloo's groups within a stage (apply/gloo_release.py), so on the CPU the
        # device rule says they are not held
        if fsdp and copies.get("held_until_next"):
            late, _ = _peak_over_backwards(
                [stage_terms(g, held, True) for g in mine_stages], actions, virtual,
                sends_per_backward, stream_bytes, output_gradient,
                [stage_terms(g, held, True, shard="zero3") for g in mine_stages]
                if regather else None)
        else:
            late = None
        # a stage after the first: M receive buffers and, under 1f1b/gpipe, the input
        # gradient it sent back last (interleaved: among the sends held above)
        receive = sum(stream_bytes * (micro_batches + (virtual == 1)) for g in mine_stages
                      if g > 0)
        send_grad = sum(stream_bytes * micro_batches for g in mine_stages
                        if g < num_stages - 1)
        peak += receive + send_grad
        chunks = [ranges[g] for g in mine_stages]
        entry = {"stage": rank, "blocks": [chunks[0].start, chunks[-1].stop - 1],
                 "peak_bytes": int(round(peak)),
                 "one_micro_batch_bytes": terms[0]["one"].bytes,
                 "saved_activation_bytes": int(round(sum(t["saved"] for t in terms))),
                 "in_flight_micro_batches": (in_flight_micro_batches(plan, rank)
                                             if virtual == 1 else max(at_peak)),
                 "p2p_buffer_bytes": int(round(receive + send_grad)),
                 "parameter_share": held, "by_category": terms[0]["one"].by_category}
        if late is not None:
            entry["peak_bytes_if_collectives_held"] = int(round(late + receive + send_grad))
        if virtual > 1:
            entry.update({"stages": mine_stages,
                          "stage_blocks": [[c.start, c.stop - 1] for c in chunks],
                          "in_flight_at_peak": list(at_peak)})
        stages.append(entry)
    worst = max(stages, key=lambda s: s["peak_bytes"])
    held_peaks = [s["peak_bytes_if_collectives_held"] for s in stages
                  if "peak_bytes_if_collectives_held" in s]
    return {**({"peak_bytes_if_collectives_held": max(held_peaks)} if held_peaks else {}),"stages": stages, "worst_stage": worst["stage"], "peak_bytes": worst["peak_bytes"],
            "schedule": plan.schedule, "microbatches": plan.pipeline_microbatches,
            "bubble_fraction": bubble_fraction(plan), "stream_bytes": int(round(stream_bytes)),
            "script_held_output_bytes": int(round(held_output_bytes)),
            "tied_gradient_bytes": int(round(float(
                timeline.size[tied & (timeline.alloc_key >= 0)].sum())))}


def _peak_over_backwards(terms: list[dict], actions, virtual: int,
                         sends_per_backward: list[int], stream_bytes: float,
                         output_gradient: list[float], regather: list[dict] | None = None
                         ) -> tuple[float, list[int] | None]:
    """The rank's peak over every backward of torch's order (``actions``) and the
    micro-batches in flight per stage there: that stage's micro-step (the first: no
    gradients of it yet; a later one: M micro-steps' accumulated), beside the saved
    activations of every micro-batch in flight on the rank's stages, the gradients of its
    stages whose backward already ran, the sends kept until the step ends and the gradient
    of the running stage's output.  ``regather`` (zero2): the stages' micro-steps with
    zero3's rows, for a backward that gathers its blocks again -- one with another
    micro-batch in flight on its stage (the backward prefetch gathers what its
    post-backward resharded), or one that follows such a backward with no forward of the
    stage between -- at least what the stage's own rows give there."""
    peak, at_peak = -1.0, None
    forwards_at_backward: list[int | None] = [None] * len(terms)
    for local, in_flight, done in pipeline_schedule.in_flight_at_backwards(actions, virtual):
        forwards = in_flight[local] + done[local]  # the stage's forwards run so far
        choices = [terms]
        if regather is not None and (in_flight[local] > 1
                                     or forwards_at_backward[local] == forwards):
            choices.append([*terms[:local], regather[local], *terms[local + 1:]])
        forwards_at_backward[local] = forwards
        value = max(_at_backward(step_terms, local, in_flight, done, sends_per_backward,
                                 stream_bytes, output_gradient) for step_terms in choices)
        if value > peak:
            peak, at_peak = value, in_flight
    return peak, at_peak


def _at_backward(terms: list[dict], local: int, in_flight, done, sends_per_backward,
                 stream_bytes: float, output_gradient: list[float]) -> float:
    """The rank's bytes at one backward of local stage ``local`` (``_peak_over_backwards``)."""
    base = terms[local]["accumulated" if done[local] else "one"].bytes
    return (base - terms[local]["saved"]
            + sum(n * t["saved"] for n, t in zip(in_flight, terms))
            + sum(terms[c]["gradients"] for c, n in enumerate(done) if n and c != local)
            + stream_bytes * sum(n * k for n, k in zip(done, sends_per_backward))
            + output_gradient[local])


def _without_ddp_bucket(timeline: Timeline, plan: Plan) -> Timeline:
    """Under ``pp`` x ``shard=ddp|zero1`` apply averages each gradient over the replicas in
    place after the schedule (apply/pipeline_data_parallel.py), with no DDP and so no
    gradient bucket: the bucket row ``sharding.shard_additions`` appends for ddp and zero1
    (the last row, alive through the step) is dropped."""
    if plan.shard not in ("ddp", "zero1") or not len(timeline):
        return timeline
    last = len(timeline) - 1
    if not (timeline.category[last] == _OTHER and timeline.alloc_key[last] == -1.0
            and timeline.free_key[last] >= timeline.n_events):
        return timeline
    sizes = timeline.size.copy()
    sizes[last] = 0.0
    return timeline.resized(sizes)


def _without_script_held_output(timeline: Timeline, outside_forward: np.ndarray,
                                first_block_key: float, backward_start: float
                                ) -> tuple[Timeline, float]:
    """The timeline with what the unmodified script held of the model's output (see the
    module's docstring) freed where the pipeline frees it: this step's at the backward's
    start, the previous step's not there at all; and the bytes of this step's (per
    micro-batch)."""
    temporary = outside_forward & (timeline.category == _TEMPORARY)
    previous = temporary & (timeline.alloc_key < 0)
    held = temporary & (timeline.alloc_key > first_block_key) \
        & (timeline.free_key > backward_start)
    if not (previous.any() or held.any()):
        return timeline, 0.0
    free_key = np.where(held, backward_start, timeline.free_key)
    retimed = timeline.retimed(timeline.alloc_key, free_key)
    return (retimed.resized(np.where(previous, 0.0, timeline.size)),
            float(timeline.size[held].sum()))


def _tied_gradients(timeline: Timeline, outside: np.ndarray, pre: np.ndarray,
                    post_forward: np.ndarray, backward: np.ndarray) -> tuple[np.ndarray, float]:
    """Gradient rows counted on the first stage (made after the blocks' backward) of a
    parameter outside the stack that an op after the stack also read in forward: a weight
    tied between the embedding and the head (GPT), whose gradient both end stages hold;
    and where the last stage makes it: the first backward row of the reading modules (the
    head's).  Found from the trace's data flow (none recorded: none found)."""
    found = np.zeros(len(timeline), bool)
    if timeline.reads is None or not post_forward.any():
        return found, 0.0
    parameters = outside & (timeline.category == _PARAMETER)
    readers = np.flatnonzero(post_forward)
    reads = [timeline.reads.of(int(r)) for r in readers]
    tied_rows = [q for each in reads for q in each if parameters[q]]
    if not tied_rows:
        return found, 0.0
    reading_modules = [timeline.module[r] for r, each in zip(readers, reads)
                       if parameters[each].any()]
    made = backward & (timeline.alloc_key >= 0) & np.isin(timeline.module, reading_modules)
    if not made.any():
        return found, 0.0
    found = pre & (timeline.category == _GRADIENT) & np.isin(
        timeline.module, np.unique(timeline.module[tied_rows]))
    return found, float(timeline.alloc_key[made].min())


def _stream_bytes(timeline: Timeline, block: np.ndarray) -> float:
    """Bytes of the stream one stage hands the next (per micro-batch): the last storage the
    first block makes in forward (its output, the residual sum)."""
    rows = np.flatnonzero((timeline.phase == _FORWARD) & (block == 0))
    if not len(rows):
        return 0.0
    return float(timeline.size[rows[np.argmax(timeline.alloc_key[rows])]])


def with_pipeline_time(cost, stages: dict, plan: Plan, link_bytes_s: float):
    """The pipelined step: the cost model already splits the work over the world's P ranks
    (each stage 1/P of it, assumed even); the bubble stretches that by (M + P - 1) / M, and
    the stream sent forward and its gradient sent back per micro-batch come on top,
    unhidden."""
    from .cost import Cost  # the cost model's result type (pure Python)

    bubble = stages["bubble_fraction"]
    compute_s = cost.step_time_s / (1.0 - bubble)
    # each of a rank's V stages sends the stream on and its gradient back per micro-batch
    p2p_bytes = (2.0 * stages["stream_bytes"] * plan.pipeline_microbatches
                 * plan.pipeline_stages_per_rank)
    p2p_s = p2p_bytes / link_bytes_s if link_bytes_s > 0 else 0.0
    terms = cost.terms + [
        (f"pp={plan.pp}: each rank idle for the bubble {_bubble_formula(plan)} = {bubble:.0%} "
         f"of the step ({plan.schedule}, M={plan.pipeline_microbatches})",
         compute_s - cost.step_time_s),
        (f"pp={plan.pp}: {p2p_bytes:,.0f} B/step of activations and their gradients between "
         "stages, unhidden", p2p_s)]
    return Cost(cost.baseline_step_s, compute_s + p2p_s, terms, cost.assumptions)


def _bubble_formula(plan: Plan) -> str:
    if plan.pipeline_stages_per_rank > 1:
        return f"(P-1)/(VM+P-1) with V={plan.pipeline_stages_per_rank}"
    return "(P-1)/(M+P-1)"
