"""Pipeline parallelism: schedules as data, their simulator, and the executor that runs them over MPI.

One concept a module, each importing only the ones before it: ``schedules`` (pure data), ``simulate``,
``render``, ``memory`` (closed forms), then the executor's internals ``lowering``, ``transport`` and
``replicas``, then ``executor`` (``Pipeline``) and ``trace``.
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
