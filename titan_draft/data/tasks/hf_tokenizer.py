"""A Hugging Face tokenizer from a local folder (tokenizer.json + tokenizer_config.json), no download."""
import json
import os

from titan_draft.data.tasks.base import token_ids
from titan_draft.infra.errors import ConfigError


def load_hf_tokenizer(path: str):
    """A real tokenizer from a local Hugging Face folder (tokenizer.json), through torchtitan."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(path)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(config: dict, key: str) -> str | None:
    """tokenizer_config.json holds a special token as "<s>" or as {"content": "<s>", ...}."""
    token = config.get(key)
    return token.get("content") if isinstance(token, dict) else token


class HFTokenizer:
    """The policy's tokenizer through the `tokenizers` library, with the special tokens and BOS rule of
    its tokenizer_config.json (special_tokens_map.json fills what that lacks)."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer

        tokenizer_json = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(tokenizer_json):
            raise ConfigError(f"model.hf_assets_path: {folder} has no tokenizer.json; point it at the policy's "
                              "Hugging Face folder (the one with tokenizer.json and tokenizer_config.json)")
        self.folder = folder
        self.backend = Tokenizer.from_file(tokenizer_json)
        self.config = {**_read_json(os.path.join(folder, "special_tokens_map.json")),
                       **_read_json(os.path.join(folder, "tokenizer_config.json"))}
        self.special = {key: _token_text(self.config, key) for key in ("bos_token", "eos_token", "pad_token")}
        self.eos_id = self._id("eos_token")
        if self.eos_id is None:
            raise ConfigError(f"model.hf_assets_path: the tokenizer in {folder} names no eos_token that its "
                              "vocabulary holds; set eos_token in its tokenizer_config.json")
        self.bos_id = self._id("bos_token")
        pad_id = self._id("pad_token")
        self.pad_id = self.eos_id if pad_id is None else pad_id
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.adds_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None

    def _id(self, key: str) -> int | None:
        text = self.special[key]
        return None if text is None else self.backend.token_to_id(text)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """add_special_tokens=False for text that already holds them (a rendered chat template)."""
        out = []
        for encoding in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens):
            ids = encoding.ids
            if add_special_tokens and self.adds_bos and ids[:1] != [self.bos_id]:
                ids = [self.bos_id, *ids]
            out.append(ids)
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def decode(self, ids) -> str:
        return self.backend.decode(token_ids(ids), skip_special_tokens=True)

    def chat_template(self) -> str | None:
        """The chat template of tokenizer_config.json (its "default" one when it holds several), or of
        chat_template.jinja beside it."""
        template = self.config.get("chat_template")
        if isinstance(template, list):
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        path = os.path.join(self.folder, "chat_template.jinja")
        if template is None and os.path.exists(path):
            with open(path) as f:
                template = f.read()
        return template

    def render_user_message(self, template: str, text: str) -> str:
        """`text` as one user turn followed by the assistant's generation prompt."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ConfigError(f"task.chat_template: the chat template in {self.folder} refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render(messages=[{"role": "user", "content": text}],
                                                add_generation_prompt=True,
                                                **{k: v for k, v in self.special.items() if v is not None})
