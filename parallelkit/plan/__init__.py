"""``parallelkit plan``: a cost model that predicts, for a model, a sample size (an image's
H x W, a volume's D x H x W), a global batch and N ranks, each grid's step time (compute,
exchange, reductions, token mixing) and peak memory per rank, and recommends the fastest.
Volumes get grids that split D too (``depth``); with blocks in (``spatial_input="blocks"``) a
rank's memory holds only its block of every input and label.

(The modules ``walk`` and ``measure`` keep their functions of the same names; import them
from there: ``parallelkit.plan.measure.measure``.)

It lives beside the layers it models and imports only what it reads (the geometry, the model
constructors, and the GAN task's training step, whose passes it counts); nothing in training
depends on it. One idea per module:

    walk         the model's leaf layers, shapes, FLOPs and parameters (a meta-device forward),
                 and the calls that mix a split sample's tokens (attention, contractions)
    measure      per-layer compute: timed on one rank (at a reduced size, scaled by operation
                 counts), or FLOPs over a rate
    devices      accelerators from their datasheets: bf16 FLOP/s, memory bandwidth and size
    network      latency + bytes / bandwidth: probed here, given, or a preset (NVLink, IB, ICI)
    grids        the process grids of N ranks that ``pk.parallelize`` takes
    machine      where the ranks run: the cores they share, a rank's memory beyond its tensors
    shares       a rank's share of a layer's map, and the halo rows it receives
    step_time    compute, exchanged activations, reductions
    mixing_cost  the token-mixing collectives: bytes, message steps, buffers held
    memory       peak memory per rank, by part
    cost         step time and memory of one grid, from all the above (pure arithmetic)
    planner      every grid ranked; the table and the JSON
    command      the ``parallelkit plan`` command line

Its accuracy on this machine is in benchmarks/results/plan_vs_measured.md.
"""

from parallelkit.plan.cost import Estimate, estimate
from parallelkit.plan.devices import DEVICES, Device
from parallelkit.plan.grids import Option, options
from parallelkit.plan.machine import Machine
from parallelkit.plan.measure import Profile, from_flops
from parallelkit.plan.network import PRESETS, Network, probe
from parallelkit.plan.planner import Plan, plan, table
from parallelkit.plan.walk import Layer, Mixing, Net, build

__all__ = [
    "DEVICES",
    "PRESETS",
    "Device",
    "Estimate",
    "Layer",
    "Machine",
    "Mixing",
    "Net",
    "Network",
    "Option",
    "Plan",
    "Profile",
    "build",
    "estimate",
    "from_flops",
    "options",
    "plan",
    "probe",
    "table",
]
