"""When parity fails: find where (``locate``) and what to keep in float32 (``precision``)."""
