"""Replay one training step of a plan: pipeline compute, transfers and the data-parallel sync.

Model (every number in seconds, bytes, FLOP/s):

- Compute. A device's effective speed is `tflops * 1e12 * mfu` (SimConfig.mfu, 0.4 by default:
  what large-model training reaches on tensor cores). A micro-batch of `micro_batch_size`
  sequences through layers [a, b) costs model.stage_flops_per_token(a, b) x tokens forward and
  2x that backward, plus one more forward when activations are recomputed (SimConfig.recompute,
  on by default because GPipe's stored activations do not fit otherwise, see memory.py).
- Pipeline transfers. The hidden state crossing a stage boundary is
  model.activation_bytes_per_sequence(SimConfig.activation_bytes) x micro_batch_size bytes
  (fp16/bf16 by default, fp32 on the CPU runtime); backward sends a gradient of the same size
  from stage s+1 to s. Plan.pipeline_compression changes the bytes per value: `bf16` 2 (never
  more than the compute dtype), `int8` 1 plus one fp32 scale per token row of d_model values
  (kernel.pipeline_message_bytes); the codec's compute is not modelled (no measured figure).
  A message on the directed link i -> j keeps the link busy for bytes * 8 / bandwidth and
  arrives latency later; a link sends one message at a time, later ones queue (FIFO). Sending
  does not stop the sender's compute (separate streams). Links are the cluster's directed
  device pairs; two pairs never share capacity (but see overlap).
- Schedule: GPipe. Each device runs the forwards of micro-batches 0..m-1 in order, then the
  backwards in reverse order m-1..0 (as modules/pipeline/stage.py does).
- Data-parallel sync of stage group s (its R devices): a ring all-reduce over the devices in
  ring order (ring_order: greedy nearest neighbour, best start). It has 2(R-1) steps; in each
  step every device sends B/R bytes to its ring successor and the next step starts when the
  slowest link of the step is done, so it takes 2(R-1) x max over ring links (latency +
  B/R * 8 / bandwidth) = 2(R-1)/R * B/bw + 2(R-1) * latency for equal links (latency x
  SimConfig.collective_latency_factor: 2 for gloo's rendezvous point-to-point). B = stage
  parameters x 4 (fp32, compression none) | 2 (fp16) | 1 + 4 / int8_block (int8 with one fp32
  scale per block). It starts when every replica of the stage has finished its last backward,
  so it overlaps with the backward of earlier stages. On the CPU runtime an fp32 all-reduce
  (compression none; the tied-embedding sum) is gloo's own algorithm instead
  (SimConfig.allreduce_algorithm "gloo", collectives.gloo_allreduce_s): the ring in ascending rank
  order, B cut into segments of at most 1 MiB (at least 2 per member), two in flight per link,
  each sent once its receiver announced the buffer.
- Tied embeddings (model.tie_embeddings, S > 1): the first and the last stage of a replica each
  hold a copy of the embedding matrix and sum their fp32 gradients every step (inner steps too)
  with a 2-rank all-reduce: 2 x max over the two directions (latency + B/2 * 8 / bandwidth),
  B = vocab x d_model x 4 (gloo's all-reduce on the CPU runtime). It starts when both ends
  finished backward; the stage groups of the two end stages start their all-reduce after it
  (as modules/train/trainer.py orders them).
- DiLoCo outer steps also pay SimConfig.outer_store_round_trips round trips between the
  farthest device and the rendezvous store on device 0 (membership agreement), per round.
- Step time = max(pipeline makespan, end of the last all-reduce) with mode `allreduce`. With
  `diloco` the outer all-reduce runs once every H inner steps: its exposed time (the same overlap
  rule) is paid once per outer round and amortised as exposed / H per step.
- Fragments (sync.fragments = F, Streaming DiLoCo): F syncs per round, each of 1/F of every
  stage's payload, so the same bytes with F ring starts (2(R-1) latencies each) and F store
  agreements. Blocking (no overlap), each exposes what runs past the step's end.
- Overlap (sync.overlap): the round's F syncs run in the background of the next round's H
  inner steps; only what exceeds H x makespan shows (plus the store agreements, which stay in
  the foreground). Contention: a sender's traffic into one region shares one link (a host's
  path into another site; the emulator's per-(rate, delay) htb class), so a background ring
  link gets the share of its link that the sender's pipeline messages into the ring
  successor's region leave free (1 - busy per step / makespan, at least 5 %); the pipeline
  keeps its speed (it is favoured: an optimistic bound for it).
- The breakdown (StepBreakdown) gives the exposed and the hidden sync time and the bytes per
  step of the pipeline and of the data-parallel sync.
- Not modelled: the optimizer step's compute, contention between different links of one host
  (but for background syncs, above), stragglers and jitter.

Modules:
- config.py: SimConfig (the knobs) and RUNTIME_PROFILES (their values for the cpu and gpu
  runtimes); runtime.py: calibration files and how profile, file and flags combine;
- kernel.py: the one cost kernel, shared with the planner's objective (cost_simulated.py):
  per-link arrays, the step's inputs and its breakdown; collectives.py: the link tables, the
  all-reduce models (ring, gloo's, compressed) and each stage group's ring;
- replay.py: the vectorised max-plus replay (what the planner and `simulate(timeline=False)`
  call); events.py: the discrete-event engine (the timeline; it checks the fast path);
- step.py: simulate() and simulate_plan() -> SimResult; report.py: the text table.
"""

from scheduler.simulator.collectives import LinkTables, ring_allreduce_time, ring_order
from scheduler.simulator.config import (
    RUNTIME_PROFILES,
    RUNTIME_SETTINGS,
    SimConfig,
    sim_config_from_record,
)
from scheduler.simulator.events import EventEngine, TimelineBox, replay_events
from scheduler.simulator.kernel import StepInputs, StepTimes, build_inputs, payload_bytes_per_param
from scheduler.simulator.replay import fast_replay, replay_fast
from scheduler.simulator.report import format_sim_table
from scheduler.simulator.runtime import (
    Calibration,
    load_calibration,
    resolve_sim_config,
    save_calibration,
)
from scheduler.simulator.step import SimResult, simulate, simulate_plan

__all__ = [
    "RUNTIME_PROFILES", "RUNTIME_SETTINGS", "Calibration", "EventEngine", "LinkTables",
    "SimConfig", "SimResult", "StepInputs", "StepTimes", "TimelineBox", "build_inputs",
    "fast_replay", "format_sim_table", "load_calibration", "payload_bytes_per_param",
    "replay_events", "replay_fast", "resolve_sim_config", "ring_allreduce_time", "ring_order",
    "save_calibration", "sim_config_from_record", "simulate", "simulate_plan",
]
