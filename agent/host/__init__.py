"""This host: GPUs, observed facts and the doctor's checks, and the state dir."""
