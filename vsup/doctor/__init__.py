"""`vsup doctor`: this machine and its vLLM install against what vLLM CPU needs."""
