"""The faces of chatkv: admin CLI, Gradio UI, admin HTTP API and metrics routes."""
