"""Training: data, distributed helpers, the step, the loop, schedules."""
