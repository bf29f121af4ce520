"""Synthetic facts in prose for Neurocache training: a sentence stated once in a long document,
and later a question about it whose answer repeats the fact's words.

Pass keys teach the cache to copy digits; these teach it to copy words, and to answer a content
question with its content rather than with a pass key. The templates are generic on purpose: none
mirrors a question of `longdoc eval qa`, which stays a held-out check.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ("Anna", "Boris", "Clara", "Daniel", "Edith", "Felix", "Greta", "Hugo", "Ida", "Jonas", "Karin", "Leo",
         "Marta", "Nils", "Olga", "Pavel", "Rosa", "Simon", "Tilda", "Viktor", "Wanda", "Yusuf", "Zora", "Emil",
         "Lotte", "Oskar", "Priya", "Ruben", "Selma", "Tomas")
THINGS = ("key", "letter", "map", "ring", "coin", "diary", "lantern", "knife", "watch", "violin", "compass", "photograph",
          "kettle", "umbrella", "necklace", "hammer", "candle", "telescope", "basket", "mirror")
PLACES = ("the floorboards", "the old oak tree", "the kitchen sink", "the chapel steps", "the broken stove",
          "the red carpet", "the garden wall", "the second bed", "the stone bridge", "the piano")
COLOURS = ("green", "yellow", "purple", "orange", "white", "black", "blue", "scarlet", "grey", "brown")
ANIMALS = ("dog", "cat", "horse", "parrot", "goat", "donkey", "rabbit", "pony")
PET_NAMES = ("Biscuit", "Captain", "Pepper", "Mustard", "Thistle", "Comet", "Nutmeg", "Domino", "Pickles", "Juniper",
             "Sprout", "Marble")
CITIES = ("Lisbon", "Krakow", "Bergen", "Naples", "Odessa", "Ghent", "Tallinn", "Seville", "Zurich", "Riga",
          "Porto", "Bruges")
TRADES = ("baker", "blacksmith", "sailor", "tailor", "miller", "carpenter", "shepherd", "printer", "locksmith",
          "glassblower")
FOODS = ("plum cake", "onion soup", "roast chestnuts", "barley bread", "pear jam", "smoked herring", "apple dumplings",
         "cheese pie")


@dataclass(frozen=True)
class Fact:
    statement: str  # stated once in the document
    question: str  # asked at the end
    answer: str  # repeats the statement's words


def _hidden(rng: random.Random, name: str) -> Fact:
    thing, place = rng.choice(THINGS), rng.choice(PLACES)
    return Fact(f"{name} hid the {thing} under {place}.", f"Where did {name} hide the {thing}?",
                f"{name} hid the {thing} under {place}.")


def _colour(rng: random.Random, name: str) -> Fact:
    thing, colour = rng.choice(THINGS), rng.choice(COLOURS)
    return Fact(f"{name} painted the {thing} {colour}.", f"What colour did {name} paint the {thing}?",
                f"{name} painted the {thing} {colour}.")


def _pet(rng: random.Random, name: str) -> Fact:
    animal, pet = rng.choice(ANIMALS), rng.choice(PET_NAMES)
    return Fact(f"{name} had a {animal} called {pet}.", f"What was the name of {name}'s {animal}?",
                f"{name}'s {animal} was called {pet}.")


def _journey(rng: random.Random, name: str) -> Fact:
    city = rng.choice(CITIES)
    return Fact(f"In the spring {name} moved to {city}.", f"Which city did {name} move to?",
                f"{name} moved to {city}.")


def _trade(rng: random.Random, name: str) -> Fact:
    trade = rng.choice(TRADES)
    return Fact(f"{name} worked as a {trade} for many years.", f"What was {name}'s trade?",
                f"{name} worked as a {trade}.")


def _food(rng: random.Random, name: str) -> Fact:
    food = rng.choice(FOODS)
    return Fact(f"Every Sunday {name} ate {food}.", f"What did {name} eat every Sunday?",
                f"Every Sunday {name} ate {food}.")


TEMPLATES = (_hidden, _colour, _pet, _journey, _trade, _food)


def facts(rng: random.Random, count: int) -> list[Fact]:
    """`count` facts about different people, the first the one asked about; the others are
    distractors, often of the same template, so only the name tells them apart."""
    names = rng.sample(NAMES, count)
    template = rng.choice(TEMPLATES)
    return [(template if i == 0 or rng.random() < 0.5 else rng.choice(TEMPLATES))(rng, name) for i, name in enumerate(names)]
