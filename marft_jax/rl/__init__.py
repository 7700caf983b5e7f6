"""marft_jax.rl"""
