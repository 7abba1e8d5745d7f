#[tokio::main]
async fn main() -> anyhow::Result<()> {
    consumer_runtime::main::<loyalty_consumer::Loyalty>().await
}
