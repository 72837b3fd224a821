"""Operations: the ``intermission`` command, the demo, the dead-letter tools, grants, doctor and the console."""
