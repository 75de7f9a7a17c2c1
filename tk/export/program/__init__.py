"""The ``torch`` format's writer and what only it uses (``writer`` holds ``WRITER``)."""
