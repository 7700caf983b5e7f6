"""marft_jax.data"""
