"""marft_jax.sampling"""
