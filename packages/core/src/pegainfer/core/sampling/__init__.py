"""Sampling parameters, token selection and structured-output masks."""
