"""A live server as the official `openai` client (and plain HTTP) sees it, for the OpenAI API tests."""

import httpx
import openai

TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?",
         "Name three rivers.", "Which is the longest?", "Thank you, that is all."]
MAX_TOKENS = 8


class Server:
    """A live server as an OpenAI client and a plain HTTP client see it."""

    def __init__(self, url: str):
        self.url = url
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def ask(self, messages, **options):
        return self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS, **options)

    def offload(self, conversation_id: str) -> None:
        assert httpx.post(f"{self.url}/v1/sessions/{conversation_id}/offload").status_code == 200

    def converse(self, turns=TURNS, **options) -> list:
        """Resends the whole conversation each turn, as OpenAI clients do, the state leaving memory between
        turns; returns each turn's completion."""
        messages, completions = [], []
        for content in turns:
            messages.append({"role": "user", "content": content})
            completion = self.ask(messages, **options)
            messages.append({"role": "assistant", "content": completion.choices[0].message.content})
            self.offload(completion.statekeeper["conversation_id"])
            completions.append(completion)
        return completions
