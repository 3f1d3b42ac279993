"""The variables of a Slurm job step's task that JAX's own Slurm detection reads (all five must be
set for it to act): with them a worker that passed no local devices would keep GPU SLURM_LOCALID."""

SLURM_STEP_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "n1",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
