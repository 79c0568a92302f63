"""Pipeline parallelism: schedules as data, their simulator, and the executor that runs them over MPI.

One concept a module, each importing only the ones listed before it:

- ``schedules``: ``PipelineSchedule``, ``Action`` and ``pipeline_schedule``,
  the per-rank action lists (pure data, no communication);
- ``simulate``: ``simulate_pipeline`` replays action lists without MPI
  (makespan, bubble, peak activations, deadlocks);
- ``render``: ``format_schedule_table`` prints them as a step-by-rank grid;
- ``memory``: ``PipelineMemoryStats``, the closed-form peak activations and bubble;
- ``lowering``: ``lower_schedule`` turns one rank's list into steps with
  explicit sends and receives (internal to the executor);
- ``transport``: ``Transport``, the point-to-point messages between stages
  (tags, shape headers, sends and receives; internal to the executor);
- ``replicas``: ``StageReplicas``, a rank's stages replicated over a
  ``dp_group`` (internal to the executor);
- ``executor``: ``Pipeline`` and ``PipelineStage``, which interpret those steps
  over point-to-point messages;
- ``trace``: gathers the executor's timelines and exports Chrome traces and
  Gantt charts.
"""
from . import executor, memory, render, schedules, simulate, trace
from .executor import Pipeline, PipelineStage
from .memory import PipelineMemoryStats
from .render import format_schedule_table
from .schedules import Action, PipelineSchedule, pipeline_schedule
from .simulate import SimulationResult, StuckAction, simulate_pipeline
from .trace import (chrome_trace, gather_timelines, timeline_bubble, timeline_from_array, timeline_to_array,
                    write_chrome_trace, write_gantt_png)

# Each module owns its list of public names; the package exports their union, lowest layer first.
__all__ = []
__all__ += schedules.__all__
__all__ += simulate.__all__
__all__ += render.__all__
__all__ += memory.__all__
__all__ += executor.__all__
__all__ += trace.__all__
