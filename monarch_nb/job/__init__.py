"""Launch and re-attach to jobs on the schedulers people run: Monarch's ``monarch.job``.

from monarch_nb.job import SlurmJob

job = SlurmJob(meshes={"trainers": 4}, gpus_per_node=8, time_limit="2:00:00")
state = job.state()                 # submits once; later calls (any kernel) re-attach
procs = state.trainers.spawn_procs(per_host={"gpus": 8}, name="train")
...
job.kill()                          # scancel: nothing is left on any node

``KubernetesJob`` lives in ``monarch_nb.job.kubernetes`` so that this package never needs the
kubernetes client.
"""

from . import _job
from ._exec import exec_command
from ._job import (
    JobError,
    JobReplacedWarning,
    JobState,
    JobTrait,
    LocalJob,
    job_load,
    job_loads,
    load_current_job,
    set_current_job,
)
from ._named import apply_spec, launch, named_job_path
from ._named import jobs as list_jobs
from ._named import kill as kill_job
from ._process import ProcessJob
from ._slurm import SlurmJob
from ._ssh import SSHJob


def __getattr__(name: str) -> str:
    # DEFAULT_JOB_PATH, Monarch's name, is read when asked: a constant computed at import kept the
    # runtime dir of that moment (and made it), though configure(runtime_dir=...) or
    # MONARCH_NB_RUNTIME_DIR set later moves where state(), jobs and kill look
    if name == "DEFAULT_JOB_PATH":
        return _job._default_job_path()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_JOB_PATH",
    "JobError",
    "JobReplacedWarning",
    "JobState",
    "JobTrait",
    "LocalJob",
    "ProcessJob",
    "SSHJob",
    "SlurmJob",
    "apply_spec",
    "exec_command",
    "job_load",
    "job_loads",
    "kill_job",
    "launch",
    "list_jobs",
    "load_current_job",
    "named_job_path",
    "set_current_job",
]
