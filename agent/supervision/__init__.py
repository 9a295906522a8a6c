"""Supervision: the backends' runtime picture, the supervisor and its health ladder, and the runners."""
