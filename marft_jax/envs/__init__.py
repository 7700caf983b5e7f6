"""marft_jax.envs"""
