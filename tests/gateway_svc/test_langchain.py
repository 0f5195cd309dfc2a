"""LangChain (``langchain-openai``) against the real gateway in front of a real verifier:
``ChatOpenAI(...).with_structured_output(SomePydanticModel)`` returns a valid object with its default
method (json_schema), and with ``json_mode`` and ``function_calling``."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field
from support import langchain_chat

langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.slow
QUESTION = 'Where is the Eiffel Tower? Answer in JSON with the keys "city" and "country".'


class Place(BaseModel):
    """Where something is."""

    city: str = Field(description="the city", max_length=16)
    country: str = Field(description="the country", max_length=16)


@pytest.fixture(scope="module")
def chat(ngram_gateway):
    return langchain_chat(ngram_gateway, max_tokens=80)


@pytest.mark.parametrize("method", [None, "json_schema", "json_mode"])
def test_with_structured_output_returns_a_valid_pydantic_object(chat, method):
    structured = chat.with_structured_output(Place, **({"method": method} if method else {}))
    place = structured.invoke(QUESTION)
    assert isinstance(place, Place) and place.city and place.country


def test_with_structured_output_by_function_calling_returns_a_valid_pydantic_object(chat):
    place = chat.with_structured_output(Place, method="function_calling").invoke(QUESTION)
    assert isinstance(place, Place) and place.city and place.country


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")  # langchain's parsed-message chunks
def test_a_streamed_structured_output_ends_in_the_same_object(chat):
    structured = chat.with_structured_output(Place, method="json_schema")
    chunks = list(structured.stream(QUESTION))
    assert chunks and chunks[-1] == structured.invoke(QUESTION)
