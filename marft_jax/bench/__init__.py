"""marft_jax.bench"""
