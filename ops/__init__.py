"""Operations: the ``intermission`` command, the demo, metrics and the dead-letter tools."""
