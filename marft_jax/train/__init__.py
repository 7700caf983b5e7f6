"""marft_jax.train"""
