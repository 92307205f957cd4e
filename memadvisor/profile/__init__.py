"""The profiler: the only writer of traces.  Imports torch (readers never need to)."""
from .runner import ProfileResult, profile_script, rank_output_path
from .session import ProfileSession, StopProfiling

__all__ = ["ProfileResult", "profile_script", "rank_output_path", "ProfileSession",
           "StopProfiling"]
