"""The ``aoti`` format's writer and what only it uses (``writer`` holds ``WRITER``)."""
