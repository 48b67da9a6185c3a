"""Every test sees 8 CPU virtual devices, as the examples do."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
