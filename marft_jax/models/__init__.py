"""marft_jax.models"""
