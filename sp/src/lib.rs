//! Sequence parallelism across cards (DESIGN.md §5). What exists today is the part every run
//! needs: the card-count rule of Ulysses attention. The communicators (loopback, NCCL/RCCL), the
//! rank group and the incremental KV exchange are the sequence-parallel issue's work.

/// Errors of the rank group.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{heads} attention heads do not split over {cards} cards (valid card counts: {valid})"
    )]
    HeadsIndivisible {
        heads: usize,
        cards: usize,
        valid: String,
    },

    #[error("--cards must be at least 1")]
    NoCards,
}

/// Heads each card holds under Ulysses, which shards attention by head: the head count must
/// divide by the card count.
pub fn heads_per_card(heads: usize, cards: usize) -> Result<usize, Error> {
    if cards == 0 {
        return Err(Error::NoCards);
    }
    if !heads.is_multiple_of(cards) {
        let valid: Vec<String> = (1..=heads)
            .filter(|c| heads.is_multiple_of(*c))
            .map(|c| c.to_string())
            .collect();
        return Err(Error::HeadsIndivisible {
            heads,
            cards,
            valid: valid.join(", "),
        });
    }
    Ok(heads / cards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_counts_follow_the_head_count() {
        assert_eq!(heads_per_card(40, 8).expect("40/8"), 5);
        assert_eq!(heads_per_card(12, 3).expect("12/3"), 4);
        let e = heads_per_card(40, 3).expect_err("40/3").to_string();
        assert!(e.contains("1, 2, 4, 5, 8, 10, 20, 40"), "{e}");
        assert!(heads_per_card(12, 0).is_err());
    }
}
