#[tokio::main]
async fn main() -> anyhow::Result<()> {
    consumer_runtime::main::<ledger_consumer::Ledger>().await
}
