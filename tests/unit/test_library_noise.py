"""A trainer process's log starts without the optional libraries' import-time warnings, and nothing else is lost."""
import logging
import subprocess
import sys

from kubetune_trainer.telemetry import library_noise


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_each_known_message_is_dropped_and_others_from_the_same_logger_pass():
    """Collected on the logger itself: a library may have stopped its loggers propagating to the root
    (transformers does once configured), which caplog would read as everything dropped."""
    library_noise.install()
    library_noise.install()  # twice: still one filter each
    for name, fragment in library_noise.KNOWN.items():
        logger = logging.getLogger(name)
        assert sum(isinstance(f, library_noise.DropMessage) for f in logger.filters) == 1, name
        collect, level, disabled = Collect(), logger.level, logger.disabled
        logger.addHandler(collect)
        logger.setLevel(logging.WARNING)
        logger.disabled = False
        try:
            logger.warning("prefix %s suffix", fragment)
            logger.warning("something else went wrong")
        finally:
            logger.removeHandler(collect)
            logger.setLevel(level)
            logger.disabled = disabled
        assert collect.messages == ["something else went wrong"], name


def test_importing_the_models_with_bitsandbytes_and_torchao_installed_is_quiet():
    code = ("import kubetune_trainer\nfrom diffusers import UNet2DConditionModel\nimport bitsandbytes, torchao\n"
            "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    for fragment in library_noise.KNOWN.values():
        assert fragment not in result.stderr, result.stderr
