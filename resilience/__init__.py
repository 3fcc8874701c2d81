"""Job health: what keeps a job of many ranks from ending in silence or in a hang. A floor above utils/, which it
watches (the process groups and the rendezvous store of utils/comm.py) and which never imports it: attached once a
run, right after comm.init (lifecycle/run.start_run: `attach(comm.get_store(), args.collective_timeout)`), detached
when the run's main function ends (its cleanups) or the next run attaches.

- job.py: what this process knows of its job (the store, the timeout, the checkpoint a restart resumes from)
- watch.py: rank 0's heartbeat in the store, each rank's freeze watch, the launcher watch
- store.py: rank 0's objects on every rank through the store (broadcast_from_rank0, on_rank0), and the store as a
  failing rank asks it (each request bounded)
- host.py: agreements over comm's host group, gloo on the CPU (max_over_ranks_on_host, HostMax, gather_on_host)
- peers.py: the job's one line when it stops: a rank's own failure, the census of lost peers, a timeout, a UserError
  every rank finds
- exits.py: exit_on_user_error, the training scripts' wrapper that says it
The rendezvous's own checks (another job's rank 0 on the port, two ranks on one GPU, room for the sockets) run inside
comm.init, before there is a job to attach to: utils/rendezvous.py.
"""
import os

from resilience import job, watch
from utils import comm
from utils.errors import register_cleanup


def attach(store, timeout):
    """Watch the job comm.init joined (every rank calls it): keep its rendezvous `store` and --collective_timeout
    (`timeout`, seconds), say a failure from now on in one line a job (resilience/exits.py), and start rank 0's
    heartbeat and each rank's freeze watch. `store` None (a single process, a dry run, a process group joined
    elsewhere): nothing to watch. A job attached before in this process is detached first."""
    detach()
    if store is None:
        return
    job.notes.update(attached=True, store=store, timeout=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the store's host: torchrun's agent, our parent
        job.notes["launcher"] = os.getppid()
    watch.start(store, comm.get_world_rank())
    register_cleanup(detach)  # when the main function (resilience.exits.exit_on_user_error) ends


def detach():
    """This process's job has ended: stop the heartbeat and the freeze watch, drop the store and what was noted (a
    later error of this process is no longer a peer's)."""
    watch.stop()
    job.notes.clear()
