"""Every environment variable tpassrun reads or writes, by name.

torchrun's names are part of the contract with user scripts (``init_process_group("env://")``,
``torch.distributed.is_torchelastic_launched()``), so they are spelled exactly as torch 2.13 spells
them. Ours all start with ``TPASSRUN_``.
"""

# --- written into every worker's environment (torchrun's contract) ---
LOCAL_RANK = "LOCAL_RANK"
RANK = "RANK"
GROUP_RANK = "GROUP_RANK"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
WORLD_SIZE = "WORLD_SIZE"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
TORCHELASTIC_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"   # "1": the agent serves the file timer
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"                 # the file timer's named pipe
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
USE_LIBUV = "USE_LIBUV"   # torch's TCPStore backend; "0" in a transparent job's workers (CRIU cannot dump io_uring)

# --- read from the launcher's own environment (torchrun's knobs) ---
PET_PREFIX = "PET_"
LOGLEVEL = "LOGLEVEL"
PYTHON_EXEC = "PYTHON_EXEC"
TORCH_ELASTIC_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
NO_COLOR = "NO_COLOR"        # https://no-color.org: set (to anything non-empty): no colour in any output
COLUMNS = "COLUMNS"          # the terminal's width, as the shell exports it: tpassctl's lines and tables fit it

# --- set for the launcher's own process only (never a worker's): gRPC (under the etcd client) kept quiet ---
# The agent forks workers (preexec_fn for PDEATHSIG) while gRPC threads exist; gRPC's fork handlers are for
# children that use gRPC, which ours never do, and only print noise. A value the user set is kept.
GRPC_QUIET = {"GRPC_ENABLE_FORK_SUPPORT": "false", "GRPC_VERBOSITY": "ERROR"}

# --- tpassrun's own ---
TPASSRUN_ETCD_BIN = "TPASSRUN_ETCD_BIN"          # etcd binary for the embedded default
TPASSRUN_CHANNEL = "TPASSRUN_CHANNEL"            # shared-memory file of the agent<->worker channel
TPASSRUN_SLOT = "TPASSRUN_SLOT"                  # this worker's slot in that file
TPASSRUN_AGENT_SOCK = "TPASSRUN_AGENT_SOCK"      # unix socket of the agent
TPASSRUN_SPARE = "TPASSRUN_SPARE"                # "1" for a warm spare waiting in tpassrun.init()
TPASSRUN_GENERATION = "TPASSRUN_GENERATION"      # generation number the worker was started in
TPASSRUN_NODE_ID = "TPASSRUN_NODE_ID"            # the agent's node id in the rendezvous
TPASSRUN_EVENT_LOG = "TPASSRUN_EVENT_LOG"        # JSON-lines event log of this agent
TPASSRUN_HANG_TIMEOUT = "TPASSRUN_HANG_TIMEOUT"  # seconds without a step heartbeat before a worker counts as hung
TPASSRUN_SHARD_MIRROR_INTERVAL = "TPASSRUN_SHARD_MIRROR_INTERVAL"  # sharded state: local copy + mirror every K steps
TPASSRUN_RUN_KEY = "TPASSRUN_RUN_KEY"  # the run key of a job of several agents (read by the agent; never a worker's)
TPASSRUN_POOL_KEY = "TPASSRUN_POOL_KEY"  # a spare pool's key (tpassrun.pool; never a worker's)
TPASSRUN_POOL_GIVEN_BACK = "TPASSRUN_POOL_GIVEN_BACK"  # a pool node's spare node: the file its pool node writes (the
                                                       # job's reason) before the SIGTERM that ends a give-back
TPASSRUN_STORE_KEY = "TPASSRUN_STORE_KEY"  # hex: the workers' store key (derived from the run's mirror key; a worker's only)
TPASSRUN_ENCRYPT = "TPASSRUN_ENCRYPT"      # "1": the run encrypts state transfers and mirror payloads (--rdzv-conf encrypt=true)
TPASSRUN_SHARE_GPUS = "TPASSRUN_SHARE_GPUS"      # "1": more slots than GPUs is allowed, slots share them
                                                 # (tpassrun/launch/devices.py)
TPASSRUN_HEALTH_FILE = "TPASSRUN_HEALTH_FILE"    # JSON readings file a site tool writes (FileSensor)
TPASSRUN_SPARE_NODES = "TPASSRUN_SPARE_NODES"    # --spare-nodes K: the last K nodes of a Slurm step are spare nodes
TPASSRUN_SCHEDULER_POLL = "TPASSRUN_SCHEDULER_POLL"  # seconds between the scheduler watcher's polls (default 5)
TPASSRUN_CRIU = "TPASSRUN_CRIU"    # the criu binary of the transparent mode (default: scripts/criu.sh's, then PATH)
TPASSRUN_SNAPSHOT_DIR = "TPASSRUN_SNAPSHOT_DIR"  # where the transparent mode keeps its snapshots (default: a temp dir)
TPASSRUN_HOPS_TRACE = "TPASSRUN_HOPS_TRACE"  # bench only, never read by tpassrun: a directory; bench/hopstrace/
                                            # sitecustomize.py (on PYTHONPATH) writes each process's moves between modules there

# --- read from Slurm (an srun step: tpassrun/scheduler/slurm.py) ---
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_STEP_ID = "SLURM_STEP_ID"                  # set by srun (not in the batch script itself)
SLURMD_NODENAME = "SLURMD_NODENAME"              # this node's name in Slurm
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"      # the step's nodes (compressed host list)
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
